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
    missing = {lib: pkg for lib, pkg in owning_packages(KILND).items()
               if pkg not in listed | SLIM_BASE}
    assert not missing, ("deploy/Dockerfile's runtime stage lacks packages for: " +
                         ", ".join(f"{pkg} ({lib})" for lib, pkg in sorted(missing.items())))
