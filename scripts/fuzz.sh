#!/usr/bin/env bash
# Sanitizer fuzzing of every native entry point that takes datagrams or
# caller-sized buffers: the switch node, the worker node, SA-ATP's helped
# host, DLCP's client, the quantiser.
# Each harness (fuzz/*.c) is built with clang's libFuzzer, AddressSanitizer
# and UndefinedBehaviorSanitizer (any report is a failure), seeded with the
# checked-in corpus (fuzz/corpus/<harness>: valid traffic for every policy,
# and a regression input for each fault found so far), and run for SECONDS
# each (default 30; CI runs 20). New inputs it finds go to build/fuzz, not
# the checked-in corpus.
#   bash scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
if ! command -v clang >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "fuzz: installing clang and its sanitizer runtimes" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang \
        libclang-rt-14-dev; } >/dev/null
  else
    echo "fuzz: needs clang with libFuzzer (Debian: apt-get install clang libclang-rt-14-dev)" >&2
    exit 2
  fi
fi
native=src/gradfabric/net/native
quant=src/gradfabric/wire/_fastquant.c
flags=(-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -std=gnu11)
mkdir -p build/fuzz
# the worker's fused quantiser, linked beside it (each library names its own gf_source)
clang "${flags[@]/-fsanitize=fuzzer,/-fsanitize=fuzzer-no-link,}" -Dgf_source=gf_quant_source \
  -c -o build/fuzz/quant.o "$quant"
declare -A sources=(
  [switch_node]="$native/switch_node.c $native/switch_pool.c $native/switch_ps.c $native/switch_help.c $native/switch_dlcp.c $native/switch_dlcp_classes.c"
  [worker]="$native/worker.c build/fuzz/quant.o"
  [host]="$native/host.c"
  [dlcp_client]="$native/dlcp_client.c $native/switch_dlcp_classes.c"
  [quant]="$quant"
)
for h in switch_node worker host dlcp_client quant; do
  # shellcheck disable=SC2086  # a list of sources
  clang "${flags[@]}" -o "build/fuzz/$h" "fuzz/$h.c" ${sources[$h]} -lm
  mkdir -p "build/fuzz/$h.new"
  echo "fuzz: $h for ${seconds} s" >&2
  if UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ASAN_OPTIONS=detect_leaks=1 \
      "build/fuzz/$h" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
      -print_final_stats=1 "build/fuzz/$h.new" "fuzz/corpus/$h" > "build/fuzz/$h.log" 2>&1; then
    grep -E "^stat::number_of_executed_units|^stat::peak_rss" "build/fuzz/$h.log" | tr '\n' ' ' >&2
    echo >&2
  else
    cat "build/fuzz/$h.log" >&2
    echo "fuzz: $h failed (the input that did it is named above)" >&2
    exit 1
  fi
done
