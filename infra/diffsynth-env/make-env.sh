#!/usr/bin/env bash
# Usage: infra/diffsynth-env/make-env.sh SIDE MAIN  (make test runs it: SIDE=.venv/diffsynth)
# A side venv for the diffsynth family's tests on a CPU torch: it reuses MAIN's site-packages
# (torch, transformers, ... through a .pth), adds diffsynth and torchvision without their
# dependencies plus the light ones diffsynth needs, and a sitecustomize defining torchvision's
# op schemas. MAIN stays free of torchvision (it breaks transformers/diffusers/peft imports there).
set -euo pipefail
side=$1
main=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$side"
"$main/bin/python" -m venv --without-pip "$side"
site=$("$side/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
main_site=$("$main/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
main_site=$(cd "$main_site" && pwd)
echo "import site; site.addsitedir('$main_site')" > "$site/_splitstage_main.pth"
cp "$here/sitecustomize.py" "$site/sitecustomize.py"
"$main/bin/python" -m pip install --quiet --no-deps --target "$site" \
  diffsynth==2.1.12 torchvision==0.28.0 einops ftfy wcwidth pandas imageio modelscope \
  modelscope-hub sentencepiece
"$side/bin/python" -c "import diffsynth.pipelines.z_image, diffsynth.pipelines.wan_video, peft"
