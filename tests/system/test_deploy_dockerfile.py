"""deploy/Dockerfile's runtime stage installs every library kilnd links: the Debian package
owning each shared object `ldd kilnd` resolves (`dpkg -S`) is in the stage's `apt-get install`
list, or is part of debian:12-slim's C/C++ runtime. A library added to the build (SQLite for
the fine-tuning store, oneDNN, CLBlast, ...) without the package fails here, not in a
container at start-up."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import KILND

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# Where the build puts backend plugins: lib/kiln/backends beside kilnd's folder's parent.
PLUGIN_DIR = Path(KILND).resolve().parents[1] / "lib" / "kiln" / "backends"
# What debian:12-slim has without asking: glibc and the C++ runtime apt itself needs.
SLIM_BASE = {"libc6", "libstdc++6", "libgcc-s1"}


def runtime_packages():
    text = DOCKERFILE.read_text()
    stage = text[text.rindex("\nFROM "):]  # the last stage is the runtime image
    m = re.search(r"apt-get install[^\\\n]*((?:\\\n[^\\\n]*)+)", stage)
    assert m, "no apt-get install in the runtime stage"
    body = "\n".join(line for line in m.group(1).split("&&")[0].splitlines()
                     if not line.strip().startswith("#"))
    words = re.findall(r"[a-z0-9][a-z0-9.+-]+", body)
    return set(words)


def owning_packages(binary):
    out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    owners = {}
    for line in out.splitlines():
        m = re.search(r"=> (/\S+)", line)
        if not m:
            continue
        path = str(Path(m.group(1)).resolve())
        r = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
        if r.returncode != 0:  # merged /usr: dpkg knows the /lib spelling
            r = subprocess.run(["dpkg", "-S", path.replace("/usr/lib/", "/lib/", 1)],
                               capture_output=True, text=True)
        assert r.returncode == 0, f"no Debian package owns {path} (linked by kilnd)"
        owners[path] = r.stdout.split(":")[0].strip()
    return owners


def test_the_runtime_image_has_every_library_kilnd_links():
    if shutil.which("dpkg") is None:
        pytest.skip("not a Debian system: no dpkg to ask which package owns a library")
    listed = runtime_packages()
    assert "libgrpc++1.51" in listed, listed  # the parser read the list
    assert "g++" in listed, "the cpu backend compiles its kernels at run time: the image needs g++"
    # kilnd and the backend plugins the image copies beside it (lib/kiln/backends); not the hip
    # plugin where the image is built without it.
    plugins = sorted(PLUGIN_DIR.glob("libkiln_backend_*.so"))
    if "-DKILN_HIP=OFF" in DOCKERFILE.read_text():
        plugins = [p for p in plugins if p.name != "libkiln_backend_hip.so"]
    binaries = [KILND] + [str(p) for p in plugins]
    for binary in binaries:
        missing = {lib: pkg for lib, pkg in owning_packages(binary).items()
                   if pkg not in listed | SLIM_BASE}
        assert not missing, (f"deploy/Dockerfile's runtime stage lacks packages for {binary}: " +
                             ", ".join(f"{pkg} ({lib})" for lib, pkg in sorted(missing.items())))


def test_the_image_copies_the_plugin_folder_the_build_fills():
    text = DOCKERFILE.read_text()
    assert "/src/build/lib/kiln/backends/ /usr/local/lib/kiln/backends/" in text
    assert PLUGIN_DIR.is_dir(), f"the build made no {PLUGIN_DIR} (backends/CMakeLists.txt)"
