#!/bin/sh
# The ferry images' entrypoint: `ferry ARGS...`, `ferry serve` when ARGS is empty or starts with a flag.
#
# Compile caches go under $FERRY_CACHE_DIR (the image's volume, /var/cache/ferry): Triton's kernels and
# ferry's C++ CPU kernels (built at first start for the node's CPU, AVX-512 or AVX2), so a restarted pod
# with the same volume starts warm. Variables already set are left alone. `exec`: ferry is PID 1's
# child no more, it is PID 1, and gets SIGTERM itself (ferry serve then drains: --drain-timeout).
set -eu
: "${FERRY_CACHE_DIR:=/var/cache/ferry}"
: "${TRITON_CACHE_DIR:=$FERRY_CACHE_DIR/triton}"
: "${TORCH_EXTENSIONS_DIR:=$FERRY_CACHE_DIR/torch_extensions}"
: "${HF_HOME:=$FERRY_CACHE_DIR/huggingface}"  # the image's root file system may be read-only
export FERRY_CACHE_DIR TRITON_CACHE_DIR TORCH_EXTENSIONS_DIR HF_HOME
mkdir -p "$TRITON_CACHE_DIR" "$TORCH_EXTENSIONS_DIR"
if [ "$#" -eq 0 ]; then
  set -- serve
fi
case "$1" in
  -*) set -- serve "$@" ;;
esac
# ferry listens on loopback unless told otherwise, and a container's loopback is reachable from
# nowhere else: `docker run IMAGE serve /models` (arguments replace the image's CMD, and its --host)
# would serve nobody. Every interface then, unless --host is given, as vLLM's images do.
case "$1" in
  serve|gateway|up)
    case " $* " in
      *" --host "*|*" --host="*) ;;
      *) set -- "$@" --host 0.0.0.0 ;;
    esac ;;
esac
exec ferry "$@"
