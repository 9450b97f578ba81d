#!/usr/bin/env bash
# Prepare a Debian/Ubuntu host for `make test-container` (run as root; .ci/run calls it): install
# rootful podman and what it needs, and set the containers.conf values this kind of machine needs,
# each only where neither /etc/containers/containers.conf nor a containers.conf.d drop-in sets it:
#
#   [containers] default_ulimits = nofile 20000, nproc 32768   defaults above the host's hard limits
#                                                               fail every `run` (setrlimit EPERM);
#                                                               nproc >= 50000 fails here too
#   [engine]     runtime = "runc"                              crun 1.8 refuses a hybrid cgroup layout
#                cgroup_manager = "cgroupfs"                   no systemd as PID 1 on CI machines
#                events_logger = "file"                        no journald either
#
# What it writes goes to /etc/containers/containers.conf.d/50-dplb.conf (a drop-in podman >= 4 reads
# after containers.conf); nothing that is set already is changed.
set -euo pipefail

need=()
for p in podman buildah mmdebstrap uidmap runc; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
    echo "podman_host_setup: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

conf=/etc/containers/containers.conf
dropdir=/etc/containers/containers.conf.d
drop=$dropdir/50-dplb.conf
is_set() {  # is key $1 set (uncommented) in containers.conf or another drop-in?
    local files=()
    [[ -f $conf ]] && files+=("$conf")
    for f in "$dropdir"/*.conf; do [[ -f $f && $f != "$drop" ]] && files+=("$f"); done
    ((${#files[@]})) && grep -Eq "^[[:space:]]*$1[[:space:]]*=" "${files[@]}"
}
containers=() engine=()
is_set default_ulimits || containers+=('default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]')
is_set runtime || engine+=('runtime = "runc"')
is_set cgroup_manager || engine+=('cgroup_manager = "cgroupfs"')
is_set events_logger || engine+=('events_logger = "file"')
if ((${#containers[@]} + ${#engine[@]})); then
    mkdir -p "$dropdir"
    {
        echo "# written by DPLB's scripts/podman_host_setup.sh (see there why)"
        if ((${#containers[@]})); then echo "[containers]"; printf '%s\n' "${containers[@]}"; fi
        if ((${#engine[@]})); then echo "[engine]"; printf '%s\n' "${engine[@]}"; fi
    } >"$drop"
    echo "podman_host_setup: wrote $drop:"
    sed 's/^/  /' "$drop"
fi
podman --version
