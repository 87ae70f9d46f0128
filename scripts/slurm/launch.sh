#!/usr/bin/env bash
# Shared body of the sbatch scripts in this folder: one `torchrun` per node under `srun`, all of them
# meeting at a c10d rendezvous on the job's first node. Sourced by ppo.sbatch, sft.sbatch and
# reward_model.sbatch after they set:
#
#   ENTRY         the entry script, relative to the repository root (train_ppo.py, scripts/train_sft.py)
#   RESUMABLE     1: the entry resumes from its latest checkpoint (trainer.resume_mode=auto), so the job
#                 requeues itself on USR1 (sent before the time limit) and torchrun restarts dead ranks;
#                 0: a restart would start over, so neither is done
#   NODE_OVERRIDES 1: append trainer.nnodes / trainer.n_gpus_per_node (keys only train_ppo.py has)
#
# and calls `launch "$@"` with the batch script's own arguments: CONFIG.yaml [section.key=value ...].
#
# Knobs from the environment (all optional):
#   PPO_ROOT        repository root (default: $SLURM_SUBMIT_DIR, i.e. where sbatch was run)
#   GPUS_PER_NODE   ranks per node (default: from Slurm's --gpus-per-node, else 8)
#   MASTER_PORT     rendezvous port (default: 20000 + job id % 10000, so two jobs sharing a head node
#                   do not collide)
#   RDZV_HOST       rendezvous host (default: the first host of the allocation)
#   MAX_RESTARTS    torchrun --max-restarts (default 3 when RESUMABLE, else 0)
#   MAX_REQUEUES    stop requeueing after this many restarts of the job (default 20)
#   PRECHECK        1 (default): validate the config for the job's world size before starting ranks
#   MIN_NODES       elastic restarts: torchrun --nnodes=MIN_NODES:<allocated nodes>, so a job whose node
#                   died restarts on the nodes left (resuming on the smaller world); the config is checked
#                   for every world size of the range, and the node layout keys are left unset
#   PYTHON, TORCHRUN  interpreters (default: the repository's .venv, else what is on PATH)
#
# The NCCL flight recorder is on (TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT): when a
# collective times out, each rank dumps its last collectives to <run folder>/nccl_trace/rank_<n>.
set -euo pipefail

log() {
    echo "[$(date '+%F %T')] launch: $*" >&2
}

# USR1 arrives (#SBATCH --signal=B:USR1@120) shortly before the time limit. Requeueing puts the job
# back in the queue with the same id; Slurm then stops this run, and the next one resumes from the
# latest complete checkpoint because trainer.resume_mode=auto. Steps since that checkpoint are redone.
on_usr1() {
    TRAPPED=1
    local restarts=${SLURM_RESTART_COUNT:-0}
    if ((restarts >= MAX_REQUEUES)); then
        log "USR1: time limit near, but the job was already requeued $restarts times (MAX_REQUEUES); not requeueing"
        return
    fi
    log "USR1: time limit near; requeueing job $SLURM_JOB_ID (restart $((restarts + 1)))"
    scontrol requeue "$SLURM_JOB_ID" || log "scontrol requeue failed; the job will end at its time limit"
}

launch() {
    if (($# < 1)) || [[ $1 == -h || $1 == --help ]]; then
        echo "usage: sbatch [--nodes=K] ${0##*/} CONFIG.yaml [section.key=value ...]" >&2
        exit 2
    fi
    local config=$1
    shift

    : "${SLURM_JOB_ID:?not inside a Slurm job: submit with sbatch (or set the SLURM_* variables)}"
    : "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}"
    local nnodes=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}

    # sbatch runs a copy of the script from Slurm's spool folder, so the repository is found from the
    # submit directory, not from $0.
    local root=${PPO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
    if [[ ! -f $root/$ENTRY ]]; then
        echo "launch: $root/$ENTRY not found; submit from the repository root or set PPO_ROOT" >&2
        exit 2
    fi
    cd "$root"
    if [[ ! -f $config ]]; then
        echo "launch: config file $config not found (relative paths are from $root)" >&2
        exit 2
    fi

    # --gpus-per-node=8 sets SLURM_GPUS_ON_NODE=8; SLURM_GPUS_PER_NODE may carry a type ("h100:8").
    local gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-8}}}
    gpus=${gpus##*:}
    local world_size=$((nnodes * gpus))
    local min_nodes=${MIN_NODES:-$nnodes}
    if ((min_nodes < 1 || min_nodes > nnodes)); then
        echo "launch: MIN_NODES=$min_nodes must be between 1 and the $nnodes allocated node(s)" >&2
        exit 2
    fi

    # The first host of the allocation runs the c10d store. mapfile reads all of scontrol's output
    # (a `| head -n1` could SIGPIPE scontrol on a long node list, which pipefail turns into a failure).
    local -a hosts
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    if ((${#hosts[@]} == 0)); then
        echo "launch: scontrol show hostnames '$SLURM_JOB_NODELIST' gave no hosts" >&2
        exit 2
    fi
    local head=${RDZV_HOST:-${hosts[0]}}
    local port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}

    local python=${PYTHON:-}
    local torchrun=${TORCHRUN:-}
    if [[ -z $python ]]; then
        if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python; fi
    fi
    if [[ -z $torchrun ]]; then
        if [[ -x .venv/bin/torchrun ]]; then torchrun=.venv/bin/torchrun; else torchrun=torchrun; fi
    fi

    # Launcher overrides go around the user's: resume_mode=auto first (a user may still pin a
    # checkpoint), the node layout last (it is what Slurm allocated, whatever the preset says).
    local -a overrides=()
    local max_restarts=${MAX_RESTARTS:-0}
    if ((RESUMABLE)); then
        overrides+=(trainer.resume_mode=auto)
        max_restarts=${MAX_RESTARTS:-3}
    fi
    overrides+=("$@")
    if ((NODE_OVERRIDES)); then
        if ((min_nodes < nnodes)); then  # the world size varies: no fixed layout to hold the run to
            overrides+=("trainer.nnodes=null" "trainer.n_gpus_per_node=null")
        else
            overrides+=("trainer.nnodes=$nnodes" "trainer.n_gpus_per_node=$gpus")
        fi
    fi

    # Fail in seconds on this node, not after every rank has loaded its model, when the batch sizes do
    # not divide over a world size the job may run on (each node count of an elastic range); the
    # message names the sizes that do not fit and, for the first, the keys to change. Missing inputs are
    # not this check's to report: every rank's start-up names them in seconds, before torch loads.
    if [[ ${PRECHECK:-1} == 1 ]]; then
        local -a bad=()
        local first_error="" n
        for ((n = min_nodes; n <= nnodes; n++)); do
            local err
            if ! err=$("$python" "$ENTRY" --config "$config" --print-config --allow-missing-paths \
                --world-size $((n * gpus)) "${overrides[@]}" 2>&1 >/dev/null); then
                bad+=("$((n * gpus)) ranks ($n node(s))")
                [[ -n $first_error ]] || first_error=$(tail -n 1 <<<"$err")
            fi
        done
        if ((${#bad[@]})); then
            local IFS=", "
            echo "launch: $config does not fit ${bad[*]} of $gpus GPU(s) a node; nothing was started: $first_error" >&2
            exit 2
        fi
    fi

    # The run folder (for the NCCL flight recorder's dumps), as the entry resolves it.
    local run_dir
    run_dir=$("$python" "$ENTRY" --config "$config" --print-config --allow-missing-paths "${overrides[@]}" 2>/dev/null |
        sed -n 's/^  output_dir: *//p' | head -n 1) || true
    export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
    export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
    if [[ -n $run_dir ]]; then
        mkdir -p "$run_dir/nccl_trace"
        export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$run_dir/nccl_trace/rank_}
    fi

    # One task per node holds all of the node's CPUs: srun does not inherit sbatch's --cpus-per-task on
    # recent Slurm, and eight ranks squeezed onto one CPU would starve the data loading and NCCL threads.
    local -a step=(srun --nodes="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1)
    if [[ -n ${SLURM_CPUS_ON_NODE:-} ]]; then
        step+=(--cpus-per-task="$SLURM_CPUS_ON_NODE")
    fi
    local -a cmd=(
        "${step[@]}"
        "$torchrun"
        --nnodes="$([[ $min_nodes -lt $nnodes ]] && echo "$min_nodes:$nnodes" || echo "$nnodes")"
        --nproc_per_node="$gpus"
        --rdzv_id="$SLURM_JOB_ID"
        --rdzv_backend=c10d
        --rdzv_endpoint="$head:$port"
        --max-restarts="$max_restarts"
        "$ENTRY" --config "$config" "${overrides[@]}"
    )
    log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $nnodes node(s) x $gpus GPU(s), rendezvous $head:$port"
    log "${cmd[*]}"

    TRAPPED=0
    if ((RESUMABLE)); then
        MAX_REQUEUES=${MAX_REQUEUES:-20}
        trap on_usr1 USR1
    fi
    # srun runs in the background and the shell waits for it: bash runs a trap only between commands,
    # and `wait` is interruptible where a foreground srun is not.
    "${cmd[@]}" &
    local pid=$! rc=0
    while true; do
        rc=0
        wait "$pid" || rc=$?
        # A trapped signal ends `wait` with 128+n, whether srun still runs or ended meanwhile (the
        # requeue stops the step): wait again, which returns srun's own status once it has ended.
        if ((rc > 128 && TRAPPED)); then
            TRAPPED=0
            continue
        fi
        break
    done
    log "srun exited with $rc"
    exit "$rc"
}
