# Sourced by the device checks (run_gpu.sh, issue50.sh) from the repository root: installs the
# carried wheels (.whl/: dp-accounting, dm-tree, jax-privacy, pydantic) beside the image's JAX,
# puts them and the checkout on the path, records the card and the stack in $OUT/gpu.txt and
# sets TAG (the card's name, lower case, tagging the logs) unless the caller set it.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib, flax, optax, chex, dp_accounting, jax_privacy; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__, 'chex', chex.__version__, 'jax_privacy', jax_privacy.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -dc 'A-Za-z0-9' | tr 'A-Z' 'a-z')}
