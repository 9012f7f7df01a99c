"""Pack what the lent GPU host lacks into one archive that fits the device tool's
64 MiB transfer: the wheels of ../shared/scripts/gpu-wheels.sh (in .whl/) and
flashinfer-python 0.7.2 cut down to the sources of its FA2 batch-prefill kernel,
unpacked and compressed together with xz. As wheels (zip, per-file deflate) the
two come to 77 MB; as one xz archive to about 41 MB.

    bash ../shared/scripts/gpu-wheels.sh && .venv/bin/python bench/gpu_bundle.py
    # then one device run with carry [".gpu"]:  OUT=$OUT bash bench/gpu.sh

The cut-down flashinfer imports as the full one does (its optional imports of
cutlass and cudnn are guarded) and JIT-builds only the batch-prefill module that
`session_runtime/model/attention.py` plans: the csrc files kept below are the ones
that module's generated sources and `nvcc -M` name. Any other flashinfer kernel
would need the full wheel.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS, OUT = ROOT / ".whl", ROOT / ".gpu"
FLASHINFER = "flashinfer-python==0.7.2"
KEEP_CSRC = {f"flashinfer/data/csrc/{name}" for name in (
    "batch_prefill.cu", "batch_prefill_jit_binding.cu", "batch_prefill_paged.cu",
    "batch_prefill_paged_jit_binding.cu", "batch_prefill_paged.cuh", "batch_prefill_customize_config.jinja",
    "batch_prefill_paged_kernel_inst.jinja", "batch_prefill_ragged_kernel_inst.jinja", "tvm_ffi_utils.h")}
DROP = ("flashinfer/data/csrc/", "flashinfer/data/cutlass/", "flashinfer/data/spdlog/")
LIMIT = 62 * 2**20  # the transfer's 64 MiB, less room for the repository itself


def dropped(name: str) -> bool:
    return name.startswith(DROP) and name not in KEEP_CSRC


def fetch_flashinfer(into: Path) -> Path:
    subprocess.run(["python3", "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", str(into), FLASHINFER], check=True)
    return next(into.glob("flashinfer_python-*.whl"))


def unpack(wheel: Path, site: Path) -> int:
    """Unzip a wheel into `site` (what pip --target does for these wheels); returns files kept."""
    kept = 0
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        if wheel.name.startswith("flashinfer_python-"):
            missing = KEEP_CSRC - set(names)
            assert not missing, f"{wheel.name} lacks {sorted(missing)}"
        for name in names:
            if not dropped(name) and not name.endswith("/"):
                z.extract(name, site)
                kept += 1
    return kept


def main() -> None:
    wheels = sorted(WHEELS.glob("*.whl"))
    if not any(w.name.startswith("sglang-") for w in wheels):
        sys.exit("no sglang wheel in .whl/: run bash ../shared/scripts/gpu-wheels.sh first")
    exclude = ROOT / ".git" / "info" / "exclude"
    if "/.gpu/" not in exclude.read_text().split():
        with exclude.open("a") as f:
            f.write("/.gpu/\n")
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        wheels.append(fetch_flashinfer(Path(tmp)))
        files = sum(unpack(w, site) for w in wheels)
        archive = OUT / "site.tar.xz"
        with archive.open("wb") as f:
            tar = subprocess.Popen(["tar", "-C", tmp, "-cf", "-", "site"], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-9", "-T0"], stdin=tar.stdout, stdout=f, check=True)
            assert tar.wait() == 0, "tar failed"
    size = archive.stat().st_size
    print(f"{archive}: {len(wheels)} wheels, {files} files, {size / 2**20:.1f} MiB")
    if size > LIMIT:
        sys.exit(f"{size / 2**20:.1f} MiB does not leave room for the repository in a 64 MiB transfer")


if __name__ == "__main__":
    main()
