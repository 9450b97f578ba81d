#!/usr/bin/env bash
# `make test-container`: build DPLB's image with podman and run it for real, with no registry (issue 31).
#
#  1. base image: a Debian rootfs of the host's own suite and archive (mmdebstrap, the host's apt
#     sources) imported as $DPLB_BASE_IMAGE; reused between runs when it exists (kept at the end)
#  2. podman build --pull=never --network=host, the host's CA bundle mounted at build time
#  3. one box: run the image (simulated engines), wait for `DPLB ready`, a chat completion and a
#     streamed completion from the host, dplb-shm-dump inside the container, the HEALTHCHECK, then
#     `podman stop`: the launcher drains and exits 0 within 10 s
#  4. /dev/shm too small (--shm-size=64k): the launcher exits 2 naming --shm-size
#  5. split: the agents (launcher --no-router) in one container, the router in a second one sharing
#     its IPC namespace (--ipc=container:) and its run dir (a volume): requests through the second
#     container's router, dplb-shm-dump there reads the first one's segment; both stop with 0
#
# Prints the image size, the build time and the time from `podman run` to ready. Containers, the
# volume and the built image are removed at the end, on failure too (DPLB_TEST_KEEP_IMAGE=1 keeps
# the image as localhost/dplb:test and reuses it on the next run). Needs root, podman, buildah,
# mmdebstrap, uidmap, runc and the containers.conf settings of scripts/podman_host_setup.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CODENAME=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
BASE=${DPLB_BASE_IMAGE:-localhost/dplb-debian-base:$CODENAME}
KEEP=${DPLB_TEST_KEEP_IMAGE:-0}    # 1: reuse localhost/dplb:test when present and keep it (iterating on the test)
if [[ $KEEP == 1 ]]; then TAG=localhost/dplb:test; else TAG=localhost/dplb:test-$$; fi
CA=/etc/ssl/certs/ca-certificates.crt
NAME=dplb-ct-$$
VOL=dplb-ct-run-$$
WORK=$(mktemp -d /tmp/dplb-ct.XXXXXX)
STOP_LIMIT_S=10

say() { echo "test-container: $*"; }
fail() { echo "test-container: FAIL: $*" >&2; exit 1; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
# podman without systemd cannot schedule the image's HEALTHCHECK (it says so on every run, "unable to
# get systemd connection"); the test runs the check itself with `podman healthcheck run`
quiet() { "$@" 2> >(grep -v "systemd connection" >&2); }
# a free port below the kernel's ephemeral range (32768+), as launcher.stack.free_port picks: an
# OS-picked port can be taken by an outgoing connection before the router binds it
free_port() { python3 -c 'import random, socket
for _ in range(200):
    p = random.randrange(20000, 32768); s = socket.socket()
    try: s.bind(("127.0.0.1", p)); break
    except OSError: pass
    finally: s.close()
print(p)'; }

cleanup() {
    local rc=$?
    if ((rc != 0)); then
        for c in "$NAME-box" "$NAME-agents" "$NAME-router"; do
            if podman container exists "$c" 2>/dev/null; then
                echo "--- podman logs $c (last 40 lines) ---" >&2
                podman logs "$c" 2>&1 | tail -40 >&2 || true
            fi
        done
    fi
    for c in "$NAME-box" "$NAME-agents" "$NAME-router" "$NAME-small"; do
        podman rm -f -t 0 "$c" >/dev/null 2>&1 || true
    done
    podman volume rm -f "$VOL" >/dev/null 2>&1 || true
    if [[ $KEEP != 1 ]]; then
        podman rmi -f "$TAG" >/dev/null 2>&1 || true
        podman image prune -f >/dev/null 2>&1 || true     # the build's dangling intermediate images
    fi
    rm -rf "$WORK"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for tool in podman mmdebstrap; do
    command -v "$tool" >/dev/null || fail "$tool is not installed: run scripts/podman_host_setup.sh as root (apt: podman buildah mmdebstrap uidmap runc)"
done
[[ $(id -u) == 0 ]] || fail "needs root (rootful podman; rootless needs subuid ranges this test does not set up)"

# ---------------------------------------------------------------------------------------------- 1
host_sources() {  # one-line `deb URI SUITE COMPONENTS` entries of the host's apt sources for $CODENAME
    python3 - "$CODENAME" <<'PY'
import glob, re, sys
code = sys.argv[1]
out = []
def keep(suite):
    return suite == code or suite.startswith(code + "-")
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"\s*deb\s+(\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.+)", line)
        if m and keep(m.group(3)):
            out.append(f"deb {m.group(2)} {m.group(3)} {m.group(4).split('#')[0].strip()}")
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in open(path).read().split("\n\n"):
        f = {}
        for line in stanza.splitlines():
            if line.strip().startswith("#") or ":" not in line:
                continue
            k, v = line.split(":", 1)
            f[k.strip().lower()] = v.split()
        if "deb" not in f.get("types", []) or f.get("enabled", ["yes"])[0] == "no":
            continue
        for uri in f.get("uris", []):
            for suite in f.get("suites", []):
                if keep(suite):
                    out.append(f"deb {uri} {suite} {' '.join(f.get('components', ['main']))}")
print("\n".join(dict.fromkeys(out)))
PY
}

if podman image exists "$BASE"; then
    say "base image $BASE present (reused)"
    base_s=0
else
    mapfile -t sources < <(host_sources)
    ((${#sources[@]})) || fail "no apt source for $CODENAME in /etc/apt/sources.list*"
    say "building the base image $BASE with mmdebstrap from: ${sources[*]}"
    t=$(now)
    # no manuals, translations or docs (copyrights kept); the dpkg options stay in the image, so
    # the Dockerfile's own apt installs follow them too
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        "$CODENAME" "$WORK/rootfs.tar" "${sources[@]}"
    podman import --change 'CMD ["/bin/bash"]' "$WORK/rootfs.tar" "$BASE" >/dev/null
    rm -f "$WORK/rootfs.tar"
    base_s=$(secs "$t" "$(now)")
    say "base image built in ${base_s} s"
fi

# ---------------------------------------------------------------------------------------------- 2
t=$(now)
if [[ $KEEP == 1 ]] && podman image exists "$TAG"; then
    say "image $TAG present (DPLB_TEST_KEEP_IMAGE=1: reused, not rebuilt)"
else
    say "podman build $TAG (BASE=$BASE)"
    podman build --pull=never --network=host --format docker --build-arg "BASE=$BASE" \
        -v "$CA:$CA:ro" -t "$TAG" -f Dockerfile . >"$WORK/build.log" 2>&1 \
        || { tail -40 "$WORK/build.log" >&2; fail "podman build failed (log above)"; }
fi
build_s=$(secs "$t" "$(now)")
size_b=$(podman image inspect --format '{{.Size}}' "$TAG")
base_b=$(podman image inspect --format '{{.Size}}' "$BASE")
size_mb=$(awk -v b="$size_b" 'BEGIN { printf "%.0f", b / 1e6 }')
base_mb=$(awk -v b="$base_b" 'BEGIN { printf "%.0f", b / 1e6 }')
say "image built in ${build_s} s: $size_mb MB ($base_mb MB of it the base)"
if podman run --rm --no-healthcheck --entrypoint sh "$TAG" -c 'command -v gcc cc cython' >/dev/null 2>&1; then
    fail "the runtime image has a compiler"
fi
[[ $(podman run --rm --no-healthcheck --entrypoint id "$TAG" -u) == 10001 ]] || fail "the image does not run as uid 10001"
[[ $(podman image inspect --format '{{.Config.StopSignal}}' "$TAG") == SIGINT ]] || fail "STOPSIGNAL is not SIGINT"

# ---------------------------------------------------------------------------------------------- helpers
wait_log() {  # wait_log CONTAINER TEXT TIMEOUT_S: until the container's output holds TEXT
    local deadline=$((SECONDS + $3))
    until podman logs "$1" 2>&1 | grep -F -- "$2" >/dev/null; do   # not -q: podman logs would get SIGPIPE
        [[ $(podman inspect --format '{{.State.Running}}' "$1") == true ]] \
            || fail "$1 exited ($(podman inspect --format '{{.State.ExitCode}}' "$1")) before '$2'"
        ((SECONDS < deadline)) || fail "no '$2' from $1 within $3 s"
        sleep 0.1
    done
}
wait_http() {  # wait_http URL TIMEOUT_S: until GET URL answers 200
    local deadline=$((SECONDS + $2))
    until curl -sf --noproxy '*' -o /dev/null "$1"; do
        ((SECONDS < deadline)) || fail "$1 did not answer 200 within $2 s"
        sleep 0.1
    done
}
chat_and_stream() {  # chat_and_stream BASE_URL: a chat completion and a streamed completion
    local base=$1 out
    out=$(curl -sf --noproxy '*' --max-time 60 "$base/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"model": "sim-llama-3.1-8b", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}') \
        || fail "chat completion through $base failed"
    python3 -c 'import json, sys; d = json.loads(sys.argv[1]); assert d["object"] == "chat.completion" and d["choices"][0]["message"]["content"], d' "$out" \
        || fail "chat completion answer: $out"
    out=$(curl -sfN --noproxy '*' --max-time 60 -i "$base/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt": "Once upon a time", "max_tokens": 8, "stream": true}') || fail "streamed completion through $base failed"
    grep -q '^data: \[DONE\]' <<<"$out" || fail "streamed completion has no [DONE]: $out"
    (($(grep -c '^data: {' <<<"$out") >= 2)) || fail "streamed completion has fewer than 2 chunks: $out"
    grep -qi '^x-dplb-worker-id: [0-9]' <<<"$out" || fail "no X-DPLB-Worker-ID header in: $out"
}
ready_workers() {  # ready_workers CONTAINER SHM: dplb-shm-dump inside CONTAINER → READY slots
    podman exec "$1" dplb-shm-dump --shm "$2" --json \
        | python3 -c 'import json, sys; d = json.load(sys.stdin); w = d["workers"] if isinstance(d, dict) else d; print(sum(1 for s in w if str(s["state"]).lower() == "ready"))'
}
stop_check() {  # stop_check CONTAINER: podman stop; exit 0 within STOP_LIMIT_S
    local t s rc
    t=$(now)
    quiet podman stop -t 30 "$1" >/dev/null
    s=$(secs "$t" "$(now)")
    rc=$(podman inspect --format '{{.State.ExitCode}}' "$1")
    ((rc == 0)) || fail "$1 exited with status $rc after podman stop"
    awk -v s="$s" -v l="$STOP_LIMIT_S" 'BEGIN { exit !(s < l) }' || fail "$1 took $s s to stop (limit $STOP_LIMIT_S s)"
    say "$1 stopped in $s s, exit status 0"
}

# ---------------------------------------------------------------------------------------------- 3
PORT=$(free_port)
say "one box: 2 simulated workers, router on 127.0.0.1:$PORT"
t=$(now)
quiet podman run -d --name "$NAME-box" --network=host --shm-size=256m -e "DPLB_HEALTH_URL=http://127.0.0.1:$PORT/health" \
    "$TAG" --num-workers 2 --port "$PORT" >/dev/null
wait_log "$NAME-box" "DPLB ready" 120
ready_s=$(secs "$t" "$(now)")
say "ready ${ready_s} s after podman run"
chat_and_stream "http://127.0.0.1:$PORT"
podman exec "$NAME-box" dplb-shm-dump --shm "dplb-$PORT"
n=$(ready_workers "$NAME-box" "dplb-$PORT")
((n == 2)) || fail "dplb-shm-dump inside the container shows $n ready workers, not 2"
podman healthcheck run "$NAME-box" >/dev/null || fail "the image's HEALTHCHECK failed on a ready launch"
stop_check "$NAME-box"
podman logs "$NAME-box" 2>&1 | grep -F "stopping (SIGINT)" >/dev/null || fail "the launcher did not see SIGINT"

# ---------------------------------------------------------------------------------------------- 4
say "a /dev/shm too small for the segment (--shm-size=64k)"
set +e
out=$(podman run --no-healthcheck --name "$NAME-small" --network=host --shm-size=64k "$TAG" --num-workers 1 --port "$(free_port)" 2>&1)
rc=$?
set -e
((rc == 2)) || fail "expected exit status 2 with a 64 KiB /dev/shm, got $rc: $out"
grep -qF -- "--shm-size" <<<"$out" || fail "the error does not name --shm-size: $out"
say "refused with status 2: $(grep -o 'error: .*needs [0-9.]* KiB' <<<"$out")"

# ---------------------------------------------------------------------------------------------- 5
PORT=$(free_port)
say "split: agents in $NAME-agents (--no-router), router in $NAME-router (--ipc=container:), port $PORT"
podman volume create "$VOL" >/dev/null
t=$(now)
quiet podman run -d --name "$NAME-agents" --network=host --ipc=shareable --shm-size=256m -v "$VOL:/run/dplb" \
    "$TAG" --no-router --num-workers 2 --port "$PORT" >/dev/null
wait_log "$NAME-agents" "DPLB ready" 120
quiet podman run -d --name "$NAME-router" --network=host --ipc="container:$NAME-agents" -v "$VOL:/run/dplb" \
    --entrypoint tini "$TAG" -- dplb-router --shm "dplb-$PORT" --port "$PORT" >/dev/null
wait_http "http://127.0.0.1:$PORT/health" 60
split_s=$(secs "$t" "$(now)")
say "split ready ${split_s} s after the first podman run"
chat_and_stream "http://127.0.0.1:$PORT"
n=$(ready_workers "$NAME-router" "dplb-$PORT")
((n == 2)) || fail "dplb-shm-dump in the router's container shows $n ready workers, not 2"
podman exec "$NAME-router" dplb-shm-dump --shm "dplb-$PORT"
stop_check "$NAME-agents"     # the workers drain first, while the router still relays
stop_check "$NAME-router"

echo
say "PASS. image $size_mb MB (base $base_mb MB); base image ${base_s} s (0: reused), build ${build_s} s;" \
    "run to ready ${ready_s} s (one box), ${split_s} s (split)"
