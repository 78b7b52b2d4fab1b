#!/usr/bin/env python3
"""Stage vLLM 0.26.0's CUDA wheel onto the lent GPU machine in parts.

The GPU machine has no network and receives only a copy of this repo's
working tree per call (64 MiB, carried paths included).  So:

  plan     (here)   slim vLLM's wheel, fetch the requirements the machine
                    lacks, pack everything as one xz-compressed tar of
                    *stored* (uncompressed) wheels, split it into
                    .whl/partNN files that each fit one call beside the
                    tracked tree, write .whl/manifest.json and print the
                    device call sequence.
  check K  (device) verify that part K arrived intact (sha256).
  rebuild  (both)   join the parts, unpack the wheels, verify every hash.
  install  (both)   rebuild, then `pip install --no-index --no-deps
                    --no-compile --target DIR` the wheels.
  sizes    (here)   tree size, part budget, and whether the parts still fit.
  smoke    (both)   import vLLM's GPU path from the installed target
                    (--fake-cuda on a CPU host: the CUDA branches, no CUDA).
  calls    (here)   print the call sequence again from the manifest.

Why stored wheels in a tar.xz: the flash-attention 3 extension deflates to
38 MB but xz packs it to about 11 MB; xz cannot do that to data that is
already deflated.  The wheels are re-zipped here (members, order, dates
and modes kept; RECORD hashes are of the members, so they stay valid) and
the device only decompresses: the wheels it rebuilds are byte-identical to
the ones hashed here, whatever zlib it has.

The device side uses the standard library and the pip CLI only (Python 3.11
here, 3.12 there).  See scripts/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE_DIR = ".whl"  # ignored by .gitignore
MANIFEST = "manifest.json"
MiB = 1 << 20
CALL_LIMIT = 64 * MiB  # what one device call may carry, tracked tree included
MARGIN = 4 * MiB  # room for the tree to grow between plan and calls
MANIFEST_RESERVE = 64 * 1024  # the manifest travels with every call
CMD_LIMIT = 2000  # characters in one device command line
CARRY_LIMIT = 8  # paths in one call's carry list

VLLM_VERSION = "0.26.0"
VLLM_WHEEL = Path("/tmp/whl/vllm/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl")
PLATFORMS = [
    "manylinux_2_17_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
    "manylinux2014_x86_64",
    "any",
]

# Members of vLLM's CUDA wheel that a dense Llama-shape bf16 model on an H100
# (SM90: FA3, no MoE, no fp8, no MLA) never loads, with the guarding line.
# "{py}" is the target CPython's tag digits (312 for 3.12).
SLIM_RULES: list[tuple[str, str]] = [
    (
        r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so",
        "FlashAttention 2. vllm/vllm_flash_attn/flash_attn_interface.py: "
        "`try: from . import _vllm_fa2_C ... except ImportError: "
        "FA2_AVAILABLE = False`; v1/attention/backends/fa_utils.py "
        "get_flash_attn_version: `if device_capability.major == 9 and "
        "is_fa_version_supported(3): fa_version = 3` (FA2 only for ALiBi or "
        "when FA3 is missing); vllm_flash_attn/__init__.py needs FA2 *or* FA3",
    ),
    (
        r"vllm/_moe_C_stable_libtorch\.abi3\.so",
        "MoE kernels. vllm/platforms/cuda.py import_kernels: `with "
        "contextlib.suppress(ImportError): import vllm._moe_C_stable_libtorch`;"
        " torch.ops._moe_C is called only from _custom_ops.py MoE helpers "
        "(fused_moe/*), and its fake is registered `if hasattr(torch.ops, "
        '"_moe_C")`',
    ),
    (
        r"vllm/vllm-rs",
        "Rust front end binary. vllm/envs.py _resolve_rust_frontend_path: "
        "`if not use_rust: ... return None` (only VLLM_USE_RUST_FRONTEND=1 "
        "looks for vllm-rs)",
    ),
    (
        r"vllm/_flashmla_C\.abi3\.so",
        "FlashMLA (MLA models). vllm/v1/attention/ops/flashmla.py: `try: "
        "import vllm._flashmla_C ... except ImportError: "
        "_flashmla_C_AVAILABLE = False`",
    ),
    (
        r"vllm/_qutlass_C\.abi3\.so",
        "MXFP4/NVFP4 kernels. vllm/platforms/cuda.py: `with "
        "contextlib.suppress(ImportError): import vllm._qutlass_C`; "
        "_custom_ops.py registers its fakes only `if "
        'hasattr(torch.ops._qutlass_C, "matmul_mxf4_bf16_tn")`',
    ),
    (
        r"vllm/third_party/deep_gemm/_C\.cpython-(?!{py}-)\d+-x86_64-linux-gnu\.so",
        "DeepGEMM extension built for another CPython: the target interpreter "
        "only loads _C.cpython-{py}-x86_64-linux-gnu.so (kept)",
    ),
]

# Requirements of vLLM 0.26.0 (and of those) that the GPU machine lacks and
# that the import path of LLM, the engine core, the GPU worker and model
# runner, Llama, the flash-attn backend, the sampler, the OpenAI server and
# the CLI imports (found by the import smoke in scripts/README.md), plus
# prometheus-fastapi-instrumentator, which `vllm serve` imports when it
# builds its app.  One version each, within vLLM's Requires-Dist.
PINS: dict[str, str] = {
    "annotated-types": "0.8.0",  # pydantic
    "apache-tvm-ffi": "0.1.10",  # vllm pins ==0.1.10; xgrammar imports it
    "cachetools": "8.0.3",
    "cbor2": "6.3.0",
    "distro": "1.9.0",  # openai
    "fastapi": "0.136.3",  # vllm: <0.137.0,>=0.133.0
    "jmespath": "1.1.0",  # model-hosting-container-standards
    "jsonschema": "4.26.0",
    "jsonschema-specifications": "2025.9.1",
    "llguidance": "1.7.6",  # vllm: <1.8.0,>=1.7.0
    "mistral-common": "1.13.1",  # its numpy<2.4 (py<=3.12) pin is not enforced
    "model-hosting-container-standards": "0.1.16",
    "msgspec": "0.23.0",
    "openai": "2.54.0",  # 3.x moved to httpx2; 2.x uses the device's httpx
    "openai-harmony": "0.0.8",
    "partial-json-parser": "0.2.1.1.post7",
    "prometheus-fastapi-instrumentator": "8.1.0",
    "pybase64": "1.5.1",
    "pycountry": "26.2.16",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "pydantic-extra-types": "2.11.1",
    "python-multipart": "0.0.34",
    "pyzmq": "27.3.0",
    "referencing": "0.37.0",
    "rpds-py": "2026.9.1",
    "sniffio": "1.3.1",
    "starlette": "1.10.0",
    "typing-inspection": "0.4.5",
    "uvicorn": "0.55.0",
    "watchfiles": "1.3.0",
    "xgrammar": "0.2.7",  # 0.2.8 needs apache-tvm-ffi>=0.1.11
}

# vLLM 0.26.0 requirements the machine lacks that are left out, and why.
NOT_STAGED: dict[str, str] = {
    "flashinfer-python": "guarded by has_flashinfer() (utils/flashinfer.py) "
    "everywhere on the dense path except v1/sample/ops/topk_topp_sampler.py "
    "flashinfer_sampler_supported(), which imports the FlashInfer backend "
    "unless VLLM_USE_FLASHINFER_SAMPLER=0: the install call exports that",
    "blake3": "multimodal/hasher.py imports it inside a function (images)",
    "setproctitle": "utils/system_utils.py: `try: import setproctitle "
    "except ImportError: return`",
    "compressed-tensors": "model_executor/layers/quantization/__init__.py "
    "get_quantization_config, only for quantized checkpoints",
    "depyf": "compilation/monitor.py and wrapper.py, only with a debug dump "
    "path (or a model that writes buffers in forward)",
    "lark, outlines_core, lm-format-enforcer": "structured output backends, "
    "imported when a request asks for one",
    "anthropic, mcp, ijson, opentelemetry-*": "imported inside functions of "
    "the Anthropic/MCP endpoints, the Mistral tool parser and tracing",
    "numba": "on the device already (vllm pins ==0.65.0; imported by the "
    "n-gram speculative proposer only)",
    "torchcodec, PyNvVideoCodec, tilelang, nvidia-cutlass-dsl, quack-kernels, "
    "humming-kernels, tokenspeed-mla, fastsafetensors, nvidia-cudnn-frontend, "
    "nvtx, python-json-logger": "not imported on the dense text path (video, "
    "MoE/MLA/FP4 kernels, optional loaders, JSON logging config)",
    "dill, email-validator": "imported only if present: torch.utils."
    "_import_utils.import_dill (`if not dill_available(): return None`), "
    "fastapi/openapi/models.py (`try: import email_validator`)",
}

# What the GPU machine already has (device/KINDS.md, read 2026-11-17;
# versions where known).  Staging any of these would shadow the machine's
# copy, so plan refuses to.
DEVICE_PACKAGES: dict[str, str | None] = {
    n: None
    for n in """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal
    annotated-doc anyio attrs botorch build certifi charset-normalizer chex click
    cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
    equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta
    jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
    kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
    ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions
    nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
    nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
    portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
    py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
    tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions
    typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
    xxhash yarl zipp""".split()
}
DEVICE_PACKAGES.update(
    {
        "huggingface-hub": "1.33.0",
        "numpy": "2.5.2",
        "safetensors": "0.8.0",
        "sentencepiece": "0.2.2",
        "tiktoken": "0.14.0",
        "tokenizers": "0.23.2",
        "torch": "2.11.0",
        "torchaudio": "2.11.0",
        "torchvision": "0.26.0",
        "transformers": "5.17.0",
        "triton": "3.6.0",
    }
)

# Exported by the install call before --then (see NOT_STAGED: flashinfer).
DEVICE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def die(msg: str) -> None:
    print(f"device_stage: error: {msg}", file=sys.stderr)
    sys.exit(1)


# ----------------------------------------------------------------- sizes


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes that travel with every call: tracked plus untracked, not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    total = 0
    for rel in set(out.decode().split("\0")):
        p = repo / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def part_budget(tree: int, limit: int = CALL_LIMIT, margin: int = MARGIN) -> int:
    """Largest part that fits one call beside the tree, the manifest and a margin."""
    budget = limit - tree - MANIFEST_RESERVE - margin
    if budget < MiB:
        raise ValueError(
            f"tree of {tree} bytes leaves {budget} bytes for a part (limit {limit})"
        )
    return budget


# --------------------------------------------------------------- wheels


def slim_rules(py: str) -> list[tuple[re.Pattern[str], str]]:
    tag = py.replace(".", "")
    return [
        (re.compile(pat.replace("{py}", tag) + r"\Z"), why.replace("{py}", tag))
        for pat, why in SLIM_RULES
    ]


def restore_wheel(
    src: Path, dst: Path, drop: list[tuple[re.Pattern[str], str]] | None = None
) -> list[dict]:
    """Rewrite wheel src as dst with every member stored (not deflated).

    Members matching a drop rule are left out and their lines removed from
    RECORD.  Names, order, dates and modes are kept, so the output is
    deterministic.  Returns the members left out.
    """
    dropped: list[dict] = []
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        keep = []
        for info in infos:
            why = next((w for rx, w in drop or [] if rx.match(info.filename)), None)
            if why is None:
                keep.append(info)
            else:
                dropped.append(
                    {
                        "member": info.filename,
                        "bytes": info.file_size,
                        "deflated": info.compress_size,
                        "reason": why,
                    }
                )
        gone = {d["member"] for d in dropped}
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
            for info in keep:
                data = zin.read(info)
                if gone and info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(
                        ln for ln in lines if ln.split(",", 1)[0] not in gone
                    ).encode()
                out = zipfile.ZipInfo(info.filename, info.date_time)
                out.external_attr = info.external_attr
                out.create_system = info.create_system
                out.compress_type = zipfile.ZIP_STORED
                zout.writestr(out, data)
    return dropped


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        name = next(
            n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)
        )
        return z.read(name).decode()


def requires_dist(path: Path) -> list[str]:
    return [
        ln.split(":", 1)[1].strip()
        for ln in wheel_metadata(path).splitlines()
        if ln.startswith("Requires-Dist:")
    ]


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canon(name), version


def marker_env(py: str) -> dict[str, str]:
    return {
        "python_version": py,
        "python_full_version": py + ".0",
        "platform_machine": "x86_64",
        "platform_system": "Linux",
        "sys_platform": "linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def audit(wheels: list[Path], py: str) -> tuple[list[str], list[str]]:
    """(errors, notes) for a staged set.

    Errors: two versions of a package, a staged package the device already
    has, a version outside vLLM's Requires-Dist.  Notes: requirements of the
    staged wheels that nothing provides, or that a known device version misses.
    """
    from pip._vendor.packaging.requirements import Requirement

    env = marker_env(py)
    staged: dict[str, str] = {}
    errors, notes = [], []
    for w in wheels:
        n, v = wheel_name_version(w)
        if n in staged:
            errors.append(f"two versions of {n}: {staged[n]} and {v}")
        staged[n] = v
        if n in DEVICE_PACKAGES:
            errors.append(f"{n} is on the device already; staging would shadow it")
    for w in wheels:
        owner = wheel_name_version(w)[0]
        for line in requires_dist(w):
            req = Requirement(line)
            if req.marker and not req.marker.evaluate(env):
                continue
            n = canon(req.name)
            have = staged.get(n) or DEVICE_PACKAGES.get(n)
            if n not in staged and n not in DEVICE_PACKAGES:
                notes.append(f"{owner} -> {line}: not staged")
            elif have and req.specifier and not req.specifier.contains(have, True):
                msg = f"{owner} -> {line}: has {have}"
                (errors if owner == "vllm" else notes).append(msg)
    return errors, sorted(set(notes))


def download(pins: dict[str, str], py: str, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    want = {canon(n): v for n, v in pins.items()}

    def found() -> dict[str, Path]:
        got = {}
        for p in dest.glob("*.whl"):
            n, v = wheel_name_version(p)
            if want.get(n) == v:
                got[n] = p
        return got

    missing = [f"{n}=={v}" for n, v in want.items() if n not in found()]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "--only-binary=:all:", "--implementation", "cp",
               "--python-version", py, "-d", str(dest)]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        subprocess.run(cmd + missing, check=True)
    got = found()
    lost = sorted(set(want) - set(got))
    if lost:
        die(f"pip download did not give: {lost}")
    return [got[n] for n in sorted(got)]


# ------------------------------------------------------------ pack/parts


def pack(
    wheels: list[Path], out: Path, part_size: int, preset: int = 6
) -> tuple[list[dict], list[dict]]:
    """Tar the (stored) wheels, xz the tar, split it into out/partNN files."""
    for old in out.glob("part*"):
        old.unlink()
    with tempfile.TemporaryFile() as blob:
        with lzma.open(blob, "wb", preset=preset) as xz, tarfile.open(
            fileobj=xz, mode="w", format=tarfile.GNU_FORMAT
        ) as tar:
            for w in sorted(wheels, key=lambda p: p.name):
                ti = tarfile.TarInfo(w.name)
                ti.size = w.stat().st_size
                ti.mode = 0o644
                with open(w, "rb") as f:
                    tar.addfile(ti, f)
        blob.seek(0)
        parts = []
        while chunk := blob.read(part_size):
            path = out / f"part{len(parts) + 1:02d}"
            path.write_bytes(chunk)
            parts.append(
                {"name": path.name, "bytes": len(chunk),
                 "sha256": hashlib.sha256(chunk).hexdigest()}
            )
    info = [
        {"name": w.name, "bytes": w.stat().st_size, "sha256": sha256_file(w)}
        for w in sorted(wheels, key=lambda p: p.name)
    ]
    return parts, info


class _Joined(io.RawIOBase):
    """The parts read back as one stream."""

    def __init__(self, paths: list[Path]):
        self._files = [open(p, "rb") for p in paths]
        self._i = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._i < len(self._files):
            n = self._files[self._i].readinto(b)
            if n:
                return n
            self._i += 1
        return 0

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()


def load_manifest(stage: Path) -> dict:
    path = stage / MANIFEST
    if not path.is_file():
        die(f"{path} is missing: carry it with every call")
    return json.loads(path.read_text())


def verify_parts(stage: Path, manifest: dict, only: int | None = None) -> list[Path]:
    paths = []
    for k, part in enumerate(manifest["parts"], 1):
        if only is not None and k != only:
            continue
        p = stage / part["name"]
        if not p.is_file():
            die(f"{p} is missing (was the machine given back between calls? "
                f"then run the whole sequence again)")
        got = sha256_file(p)
        if p.stat().st_size != part["bytes"] or got != part["sha256"]:
            die(f"{p} is corrupt: sha256 {got}, size {p.stat().st_size}; "
                f"manifest says {part['sha256']}, size {part['bytes']}")
        paths.append(p)
    return paths


def rebuild(stage: Path, dest: Path) -> list[Path]:
    """Join and verify the parts, unpack and verify the wheels into dest."""
    manifest = load_manifest(stage)
    paths = verify_parts(stage, manifest)
    want = {w["name"]: w for w in manifest["wheels"]}
    dest.mkdir(parents=True, exist_ok=True)
    done = []
    with _Joined(paths) as raw, lzma.open(io.BufferedReader(raw, MiB)) as xz:
        with tarfile.open(fileobj=xz, mode="r|") as tar:
            for ti in tar:
                if not ti.isfile() or ti.name not in want or "/" in ti.name:
                    die(f"unexpected tar member {ti.name!r}")
                target = dest / ti.name
                h = hashlib.sha256()
                with tar.extractfile(ti) as src, open(target, "wb") as f:
                    for block in iter(lambda: src.read(MiB), b""):
                        h.update(block)
                        f.write(block)
                if h.hexdigest() != want[ti.name]["sha256"]:
                    die(f"rebuilt {ti.name} has sha256 {h.hexdigest()}, "
                        f"manifest says {want[ti.name]['sha256']}")
                done.append(target)
    missing = set(want) - {p.name for p in done}
    if missing:
        die(f"wheels missing from the parts: {sorted(missing)}")
    return done


# ------------------------------------------------------------ call plan


def calls(
    manifest: dict,
    then: str = "",
    target: str = "/tmp/site",
    stage: str = STAGE_DIR,
    extra: list[str] | None = None,
) -> list[dict]:
    """The device `run` calls, in order: one per part; the last also installs the wheels and
    this plugin from the tree (its entry points are how vLLM finds it)."""
    script = "python3 scripts/device_stage.py"
    opt = "" if stage == STAGE_DIR else f" --stage {shlex.quote(stage)}"
    parts = manifest["parts"]
    seq = []
    for k, part in enumerate(parts, 1):
        carry = [f"{stage}/{part['name']}", f"{stage}/{MANIFEST}"]
        cmd = f"{script} check {k}{opt}"
        if k == len(parts):
            carry += list(extra or [])
            cmd += f" && {script} install{opt} --target {target}"
            cmd += (f" && python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile"
                    f" --upgrade --target {target} .")
            env = " ".join(f"{name}={val}" for name, val in DEVICE_ENV.items())
            cmd += f" && export PYTHONPATH={target}:$PWD PATH={target}/bin:$PATH {env}"
            if then:
                cmd += f" && {then}"
        seq.append({"carry": carry, "command": cmd})
    for c in seq:
        if len(c["command"]) > CMD_LIMIT:
            raise ValueError(f"command over {CMD_LIMIT} characters: {c['command']}")
        if len(c["carry"]) > CARRY_LIMIT:
            raise ValueError(f"carry over {CARRY_LIMIT} paths: {c['carry']}")
    return seq


def print_calls(manifest: dict, then: str, stage: str = STAGE_DIR) -> None:
    seq = calls(manifest, then, stage=stage)
    print(f"\nDevice calls ({len(seq)}, back to back: the machine is given back "
          "after 30 s idle and the parts are lost with it):")
    for k, c in enumerate(seq, 1):
        print(f"  call {k}: carry={json.dumps(c['carry'])}")
        print(f"          command={c['command']}")


# ------------------------------------------------------------- commands


def cmd_plan(a: argparse.Namespace) -> None:
    t0 = time.monotonic()
    stage = REPO / a.out
    stage.mkdir(parents=True, exist_ok=True)
    tree = tree_bytes()
    budget = a.part_bytes or part_budget(tree, margin=a.margin_mib * MiB)
    if not Path(a.vllm_wheel).is_file():   # vLLM's own wheel (abi3: one for every Python)
        got = download({"vllm": VLLM_VERSION}, a.python_version, VLLM_WHEEL.parent)
        a.vllm_wheel = str(got[0])
    deps = download(PINS, a.python_version, Path(a.deps_dir or
                    f"/tmp/whl/deps-cp{a.python_version.replace('.', '')}"))
    t_dl = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="device_stage_") as tmp:
        stored = []
        dropped = restore_wheel(Path(a.vllm_wheel), Path(tmp) / Path(a.vllm_wheel).name,
                                slim_rules(a.python_version))
        stored.append(Path(tmp) / Path(a.vllm_wheel).name)
        for w in deps:
            restore_wheel(w, Path(tmp) / w.name)
            stored.append(Path(tmp) / w.name)
        errors, notes = audit(stored, a.python_version)
        if errors:
            die("; ".join(errors))
        t_slim = time.monotonic()
        parts, wheels = pack(stored, stage, budget, a.preset)
    sources = {w.name: w for w in deps + [Path(a.vllm_wheel)]}
    for w in wheels:
        w["source_bytes"] = sources[w["name"]].stat().st_size
        w["source_sha256"] = sha256_file(sources[w["name"]])
    manifest = {
        "format": "tar of stored wheels, xz (preset %d), split" % a.preset,
        "python_version": a.python_version,
        "vllm_source": {"name": Path(a.vllm_wheel).name,
                        "bytes": Path(a.vllm_wheel).stat().st_size},
        "tree_bytes_at_plan": tree,
        "part_budget": budget,
        "parts": parts,
        "wheels": wheels,
        "left_out": dropped,
        "not_staged": NOT_STAGED,
        "requirement_notes": notes,
    }
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    t1 = time.monotonic()
    print(f"python {a.python_version}: {len(wheels)} wheels, "
          f"{sum(w['bytes'] for w in wheels):,} bytes stored")
    for w in wheels:
        print(f"  {w['bytes']:>12,}  {w['name']}")
    print("left out of vllm:")
    for d in dropped:
        print(f"  {d['deflated']:>12,} deflated  {d['member']}")
    print("requirements not staged (not on the import path) or not met:")
    for line in notes:
        print(f"  {line}")
    print(f"tree {tree:,} bytes; part budget {budget:,} bytes")
    for p in parts:
        print(f"  {p['bytes']:>12,}  {a.out}/{p['name']}  {p['sha256'][:16]}")
    print(f"staged total {sum(p['bytes'] for p in parts):,} bytes in "
          f"{len(parts)} parts; plan {t1 - t0:.1f} s (download {t_dl - t0:.1f} s, "
          f"restore {t_slim - t_dl:.1f} s, xz {t1 - t_slim:.1f} s)")
    print_calls(manifest, a.then, a.out)


def cmd_check(a: argparse.Namespace) -> None:
    stage = REPO / a.stage
    manifest = load_manifest(stage)
    n = len(manifest["parts"])
    if not 1 <= a.k <= n:
        die(f"part {a.k} of {n}?")
    verify_parts(stage, manifest, only=a.k)
    here = [p["name"] for p in manifest["parts"] if (stage / p["name"]).is_file()]
    print(f"part {a.k}/{n} ok; present: {' '.join(here)}")


def cmd_rebuild(a: argparse.Namespace) -> list[Path]:
    t0 = time.monotonic()
    wheels = rebuild(REPO / a.stage, Path(a.dest))
    print(f"rebuilt {len(wheels)} wheels into {a.dest}, hashes verified "
          f"({time.monotonic() - t0:.1f} s)")
    return wheels


def cmd_install(a: argparse.Namespace) -> None:
    t0 = time.monotonic()
    wheels = cmd_rebuild(a)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", a.target]
    cmd += shlex.split(a.pip_args) + [str(w) for w in sorted(wheels)]
    subprocess.run(cmd, check=True)
    if not a.keep:
        shutil.rmtree(a.dest, ignore_errors=True)
    print(f"installed into {a.target} ({time.monotonic() - t0:.1f} s in all); "
          f"export PYTHONPATH={a.target}")


def cmd_sizes(a: argparse.Namespace) -> None:
    tree = tree_bytes()
    budget = part_budget(tree, margin=a.margin_mib * MiB)
    print(f"tree {tree:,} bytes (tracked + untracked not ignored); "
          f"call limit {CALL_LIMIT:,}; part budget {budget:,}")
    stage = REPO / a.stage
    if (stage / MANIFEST).is_file():
        manifest = load_manifest(stage)
        for k, p in enumerate(manifest["parts"], 1):
            room = CALL_LIMIT - tree - p["bytes"] - (stage / MANIFEST).stat().st_size
            print(f"  {p['name']}: {p['bytes']:,} bytes, "
                  f"{'fits' if room > 0 else 'DOES NOT FIT'} ({room:,} to spare)")


def cmd_calls(a: argparse.Namespace) -> None:
    print_calls(load_manifest(REPO / a.stage), a.then, a.stage)


SMOKE_MODULES = """vllm vllm.engine.arg_utils vllm.engine.llm_engine vllm.v1.engine.core
vllm.v1.engine.llm_engine vllm.v1.engine.async_llm vllm.v1.executor.uniproc_executor
vllm.v1.worker.gpu_worker vllm.v1.worker.gpu_model_runner vllm.v1.worker.gpu.model_runner
vllm.model_executor.models.llama vllm.model_executor.model_loader.default_loader
vllm.v1.attention.backends.flash_attn vllm.v1.attention.backends.fa_utils
vllm.v1.sample.sampler vllm.v1.core.sched.scheduler vllm.entrypoints.llm
vllm.entrypoints.openai.api_server vllm.entrypoints.cli.main vllm.entrypoints.cli.serve
vllm.entrypoints.serve.instrumentator.metrics vllm_kunserve""".split()


def cmd_smoke(a: argparse.Namespace) -> None:
    """Import what vLLM's GPU path imports (run with PYTHONPATH=<target>:$PWD).

    --fake-cuda (CPU hosts only), after the imports: stub
    vllm._C_stable_libtorch, which needs libcuda.so.1, and make CudaPlatform
    current, so that `vllm serve --help`, the OpenAI app and the sampler take
    their CUDA branches.  No CUDA runs.
    """
    import contextlib
    import importlib
    import types

    t0 = time.monotonic()
    bad, ran = [], 0
    for name in SMOKE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # report every module, not just the first
            bad.append(f"{name}: {type(e).__name__}: {e}")
    try:
        from vllm import LLM, SamplingParams  # noqa: F401
    except Exception as e:
        bad.append(f"from vllm import LLM, SamplingParams: {e!r}")
    if a.fake_cuda and not bad:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("stub")
        import vllm.platforms as platforms
        from vllm.platforms.cuda import CudaPlatform

        platforms._current_platform = CudaPlatform()
        ran = 3  # serve --help, the app, the sampler
        from vllm.entrypoints.cli.main import main as vllm_main
        from vllm.entrypoints.openai.api_server import build_app
        from vllm.entrypoints.openai.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.sample.ops import topk_topp_sampler

        argv, sys.argv = sys.argv, ["vllm", "serve", "--help"]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            with contextlib.suppress(SystemExit):
                vllm_main()
        sys.argv = argv
        print(f"vllm serve --help: {len(out.getvalue().splitlines())} lines")
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"])
        app = build_app(args, supported_tasks=("generate",))
        print(f"OpenAI app: {len(app.routes)} routes")
        topk_topp_sampler.current_platform.is_cuda = lambda: True
        try:
            sampler = topk_topp_sampler.TopKTopPSampler()
            print(f"sampler: {sampler.forward.__name__}")
        except Exception as e:
            bad.append(f"TopKTopPSampler on CUDA: {e!r}")
    checks = len(SMOKE_MODULES) + 1 + ran
    print(f"smoke: {checks - len(bad)} of {checks} checks ok "
          f"({time.monotonic() - t0:.1f} s)")
    for line in bad:
        print(f"  FAIL {line}")
    if bad:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="build .whl/partNN + manifest, print the calls")
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--vllm-wheel", default=str(VLLM_WHEEL))
    p.add_argument("--deps-dir", help="download cache (default /tmp/whl/deps-cpXY)")
    p.add_argument("--out", default=STAGE_DIR, help="relative to the repo root")
    p.add_argument("--margin-mib", type=int, default=MARGIN // MiB)
    p.add_argument("--part-bytes", type=int, help="override the computed budget")
    p.add_argument("--preset", type=int, default=6, help="xz preset (0-9)")
    p.add_argument("--then", default="", help="command the last call runs")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("check", help="verify part K (device)")
    p.add_argument("k", type=int)
    p.add_argument("--stage", default=STAGE_DIR)
    p.set_defaults(fn=cmd_check)
    for name, fn in (("rebuild", cmd_rebuild), ("install", cmd_install)):
        p = sub.add_parser(name, help=f"{name} from the parts (device or here)")
        p.add_argument("--stage", default=STAGE_DIR)
        p.add_argument("--dest", default="/tmp/device_stage/wheels")
        if name == "install":
            p.add_argument("--target", default="/tmp/site")
            p.add_argument("--pip-args", default="",
                           help="extra pip arguments, e.g. --python-version 3.12 ...")
            p.add_argument("--keep", action="store_true", help="keep the wheels")
        p.set_defaults(fn=fn)
    p = sub.add_parser("sizes", help="tree size, part budget, do the parts fit")
    p.add_argument("--stage", default=STAGE_DIR)
    p.add_argument("--margin-mib", type=int, default=MARGIN // MiB)
    p.set_defaults(fn=cmd_sizes)
    p = sub.add_parser("smoke", help="import vLLM's GPU path (after install)")
    p.add_argument("--fake-cuda", action="store_true",
                   help="CPU host: stub the CUDA kernels, take the CUDA branches")
    p.set_defaults(fn=cmd_smoke)
    p = sub.add_parser("calls", help="print the device calls from the manifest")
    p.add_argument("--stage", default=STAGE_DIR)
    p.add_argument("--then", default="")
    p.set_defaults(fn=cmd_calls)
    a = ap.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
