# shellcheck shell=sh

if command -v nvidia-smi >/dev/null 2>&1; then
  echo "@nvidia"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits 2>&1 || echo "@failed $?"
fi
if command -v rocm-smi >/dev/null 2>&1; then
  echo "@rocm"
  rocm-smi --showproductname --showmeminfo vram 2>&1 || echo "@failed $?"
fi
echo "@end"
