# Sourced by the install scripts: `pip_install PYTHON ARGS...` is `PYTHON -m pip install ARGS`,
# retried. CI downloads ~2 GB from PyPI on a fresh machine, and one dropped connection in a
# large wheel (triton, 286 MB) failed a whole run; pip's own resume gives up after 5 tries at the
# same offset, so a whole new attempt, after a pause, starts the download afresh.
export PIP_RESUME_RETRIES="${PIP_RESUME_RETRIES:-20}" PIP_RETRIES="${PIP_RETRIES:-10}"
export PIP_DEFAULT_TIMEOUT="${PIP_DEFAULT_TIMEOUT:-60}"
# No wheel cache: the venvs hold what is installed, and a cache's extra GBs once filled CI's disk.
export PIP_NO_CACHE_DIR="${PIP_NO_CACHE_DIR:-1}"

pip_install() {
  local py="$1" attempt
  shift
  for attempt in 1 2 3 4; do
    if "$py" -m pip install --quiet "$@"; then return 0; fi
    echo "pip install $* failed (attempt $attempt of 4); retrying in $((attempt * 20)) s" >&2
    sleep $((attempt * 20))
  done
  return 1
}
