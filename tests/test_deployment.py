"""The capstone's deployment files, validated offline with the real libraries and tools.

* Kubernetes: the PyTorchJob is deserialized into the kubeflow-training client's models
  (``KubeflowOrgV1PyTorchJob``, with the kubernetes client's pod models inside), the TrainJob
  into kubeflow-trainer-api's (``TrainerV1alpha1TrainJob``); both are serialized back and must
  equal the file (the clients drop keys they do not know: a misspelt key would vanish);
  replicas, GPUs, volumes and the command running our module are checked on the models.
* docker compose: both files parsed by ``compose_spec.PyCompose.from_yaml`` (which refuses
  unknown keys); every service runs torchrun with the same rendezvous endpoint, on a host that
  is one of the services, with the node count equal to the number of services.
* the Dockerfile: its instructions parsed (continuations joined): a base image, the locked
  environment installed with ``uv sync --frozen``, a non-root USER last, torchrun on our module.
* Slurm: ``bash -n``, then the script run with stub ``scontrol``, ``srun`` and ``uv`` on PATH:
  srun starts one task per node, and every task's torchrun gets the same c10d endpoint (the
  first host of ``scontrol show hostnames``), the node and GPU counts, the job id as the
  rendezvous id, and the network interface variables. No docker engine, cluster or Slurm needed.
"""

from __future__ import annotations

import json
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

from solutions.phase4_production.imagenet.config import load_config

pytestmark = pytest.mark.reference
ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "solutions" / "phase4_production" / "imagenet" / "deployment"
MODULE = "solutions.phase4_production.imagenet.trainer"


def fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where two YAML/JSON trees differ (the keys a client dropped or added)."""
    if isinstance(got, dict) and isinstance(want, dict):
        out = [f"{path}/{k}: missing after the round trip" for k in want if k not in got]
        out += [f"{path}/{k}: added by the round trip" for k in got if k not in want]
        for key in set(got) & set(want):
            out += differences(got[key], want[key], f"{path}/{key}")
        return out
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            return [f"{path}: {len(want)} items became {len(got)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(got, want, strict=True))
            for d in differences(a, b, f"{path}[{i}]")
        ]
    return [] if got == want else [f"{path}: {want!r} became {got!r}"]


def as_args(command: Any) -> list[str]:
    """A compose ``command``: a list, or a string in shell form."""
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def module_args(command: list[str], what: str) -> list[str]:
    """The arguments after ``-m <our module>`` of a torchrun command line."""
    if not command or command[0] != "torchrun":
        fail(f"{what}: the command should start with torchrun, got {command}")
    if "-m" not in command or command[command.index("-m") + 1] != MODULE:
        fail(f"{what}: the command should run -m {MODULE}, got {command}")
    return command[command.index("-m") + 2 :]


def flag(command: list[str], name: str) -> str | None:
    """The value of ``--name=value`` (or ``--name value``) before ``-m``."""
    head = command[: command.index("-m")] if "-m" in command else command
    for i, arg in enumerate(head):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(head):
            return head[i + 1]
    return None


def trainer_config(args: list[str]) -> Any:
    """The trainer's own validation of the arguments a manifest passes (no data, no GPUs)."""
    from solutions.phase4_production.imagenet.trainer import parse_args

    name, overrides, _ = parse_args(args)
    return load_config(name, overrides)


# ----------------------------------------------------------------------------- Kubernetes


def test_the_pytorchjob_deserializes_into_the_kubeflow_training_models() -> None:
    from kubeflow.training.api_client import ApiClient
    from kubeflow.training.models import KubeflowOrgV1PyTorchJob
    from kubeflow.training.utils.utils import FakeResponse

    raw = yaml.safe_load((DEPLOY / "kubernetes" / "pytorchjob.yaml").read_text())
    client = ApiClient()
    job = client.deserialize(FakeResponse(raw), "KubeflowOrgV1PyTorchJob")
    assert isinstance(job, KubeflowOrgV1PyTorchJob)
    lost = differences(client.sanitize_for_serialization(job), raw)
    if lost:
        fail(f"pytorchjob.yaml: keys the PyTorchJob model does not know: {lost}")
    assert (job.api_version, job.kind) == ("kubeflow.org/v1", "PyTorchJob")
    spec = job.spec
    assert spec.elastic_policy.rdzv_backend == "c10d", "torchrun must meet at a c10d rendezvous"
    workers = spec.pytorch_replica_specs["Worker"]
    assert (
        workers.replicas
        == spec.elastic_policy.min_replicas
        == spec.elastic_policy.max_replicas
        == 2
    )
    assert workers.restart_policy == "OnFailure"
    pod = workers.template.spec
    assert pod.security_context.run_as_non_root and pod.security_context.run_as_user != 0
    (container,) = pod.containers
    assert container.name == "pytorch", "the training operator finds its container by this name"
    gpus = int(container.resources.limits["nvidia.com/gpu"])
    assert (
        gpus == int(spec.nproc_per_node) == int(flag(container.command, "nproc-per-node") or 0) == 8
    )
    cfg = trainer_config(module_args(container.command, "pytorchjob.yaml"))
    assert cfg.global_batch(workers.replicas * gpus) == 4096
    mounts = {m.mount_path: m for m in container.volume_mounts}
    assert cfg.data.root == "/data/imagenet" and mounts["/data/imagenet"].read_only
    assert cfg.checkpoint.dir.startswith("/checkpoints/") and "/dev/shm" in mounts
    claims = {v.name: v.persistent_volume_claim for v in pod.volumes if v.persistent_volume_claim}
    assert {mounts["/checkpoints"].name, mounts["/data/imagenet"].name} <= set(claims)
    env = {e.name: e.value for e in container.env}
    assert env.get("NCCL_SOCKET_IFNAME") and env.get("GLOO_SOCKET_IFNAME")


def test_the_trainjob_deserializes_into_the_trainer_v2_models() -> None:
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    raw = yaml.safe_load((DEPLOY / "kubernetes" / "trainjob.yaml").read_text())
    job = TrainerV1alpha1TrainJob.from_dict(raw)
    assert job is not None
    lost = differences(job.to_dict(), raw)
    if lost:
        fail(f"trainjob.yaml: keys the TrainJob model does not know: {lost}")
    assert (job.api_version, job.kind) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job.spec.runtime_ref.name == "torch-distributed"
    trainer = job.spec.trainer
    assert trainer.num_nodes == 2 and trainer.num_proc_per_node == 8
    assert trainer.resources_per_node.limits["nvidia.com/gpu"].actual_instance == "8"
    assert flag(trainer.command, "rdzv-backend") == "c10d"
    endpoint = flag(trainer.command, "rdzv-endpoint") or ""
    assert endpoint.startswith(f"{job.metadata.name}-node-0-0."), endpoint
    cfg = trainer_config(module_args(trainer.command, "trainjob.yaml"))
    assert cfg.global_batch(trainer.num_nodes * trainer.num_proc_per_node) == 4096
    (patch,) = job.spec.runtime_patches
    (replicated,) = patch.training_runtime_spec.template.spec.replicated_jobs
    pod = replicated.template.spec.template.spec
    assert replicated.name == "node" and pod.security_context.run_as_non_root
    mounts = {m.mount_path: m.name for m in pod.containers[0].volume_mounts}
    volumes = {v.name for v in pod.volumes}
    assert {"/data/imagenet", "/checkpoints", "/dev/shm"} <= set(mounts)
    assert set(mounts.values()) <= volumes


# ----------------------------------------------------------------------------- docker compose


@pytest.mark.parametrize(
    "files", [("docker-compose.yaml",), ("docker-compose.yaml", "docker-compose.gpu.yaml")]
)
def test_compose_services_meet_at_one_rendezvous(files: tuple[str, ...]) -> None:
    from compose_spec import PyCompose

    base = PyCompose.from_yaml((DEPLOY / files[0]).read_text())
    services = base.services or {}
    commands = {name: as_args(s.command) for name, s in services.items()}
    for extra in files[1:]:
        override = PyCompose.from_yaml((DEPLOY / extra).read_text())
        for name, service in (override.services or {}).items():
            assert name in services, f"{extra}: {name} is not a service of {files[0]}"
            if service.command is not None:
                commands[name] = as_args(service.command)
    endpoints = {flag(c, "rdzv-endpoint") for c in commands.values()}
    if len(endpoints) != 1:
        fail(f"{files}: every service must use one rendezvous endpoint, got {endpoints}")
    host = str(next(iter(endpoints))).split(":")[0]
    hostnames = {s.hostname or name for name, s in services.items()}
    assert host in hostnames, f"{files}: the endpoint host {host} is none of the services"
    for name, command in commands.items():
        args = module_args(command, f"{files} {name}")
        assert flag(command, "rdzv-backend") == "c10d"
        assert flag(command, "nnodes") == str(len(services)), f"{name}: --nnodes"
        assert len({flag(c, "rdzv-id") for c in commands.values()}) == 1
        assert int(flag(command, "max-restarts") or 0) >= 1
        cfg = trainer_config(args)
        world = len(services) * int(flag(command, "nproc-per-node") or 0)
        assert cfg.global_batch(world) >= world
        assert cfg.checkpoint.dir.startswith("/checkpoints/"), "checkpoints on the shared volume"
    for name, service in services.items():
        assert any(str(v).endswith(":/checkpoints") for v in service.volumes or ()), name
        env: Any = service.environment or {}
        assert env.get("GLOO_SOCKET_IFNAME") and env.get("NCCL_SOCKET_IFNAME"), name


def test_compose_spec_refuses_an_unknown_key() -> None:
    from compose_spec import PyCompose

    with pytest.raises(ValueError, match="imagee"):
        PyCompose.from_yaml("services:\n  node0:\n    imagee: dtfs-imagenet\n")


# ----------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with backslash continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_the_dockerfile_installs_the_lock_and_runs_as_a_user() -> None:
    instructions = dockerfile_instructions((DEPLOY / "Dockerfile").read_text())
    keywords = [k for k, _ in instructions]
    assert keywords[0] == "FROM" and "python:3.11" in instructions[0][1]
    syncs = [args for k, args in instructions if k == "RUN" and "uv sync" in args]
    assert syncs and all("--frozen" in s for s in syncs), "uv sync --frozen: exactly the lock"
    assert any("uv.lock" in args for k, args in instructions if k in ("RUN", "COPY"))
    users = [args for k, args in instructions if k == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        fail(f"Dockerfile: the last USER must not be root, got {users}")
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN")
    cmd = json.loads(dict(instructions)["CMD"])
    module_args(cmd, "Dockerfile CMD")
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and "checkpoints" in ignore


# ----------------------------------------------------------------------------- Slurm


STUBS = {
    "scontrol": """#!/bin/bash
# scontrol show hostnames gpu-[001-002] -> one host per line, the first one written alone
# (a reader that stops after it, `| head -n 1`, makes the later writes fail with SIGPIPE)
[ "$1 $2" = "show hostnames" ] || exit 1
prefix=${3%%[*}; range=${3#*[}; range=${range%]}
hosts=$(seq -w ${range%-*} ${range#*-})
echo "$prefix${hosts%%$'\n'*}"; sleep 0.3
for i in ${hosts#*$'\n'}; do echo "$prefix$i"; done
""",
    "srun": """#!/bin/bash
# one task per node, as srun --ntasks-per-node=1 would start them
echo "$@" > "$STUB_DIR/srun.args"
while [[ "$1" == --* ]]; do shift; done
for ((n = 0; n < SLURM_JOB_NUM_NODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n SLURMD_NODENAME=host$n "$@" || exit $?
done
""",
    "uv": """#!/bin/bash
# uv sync: remember it; uv run --no-sync CMD: run CMD
if [ "$1" = "sync" ]; then echo "$@" >> "$STUB_DIR/uv.sync"; exit 0; fi
shift; [ "$1" = "--no-sync" ] && shift
exec "$@"
""",
    "torchrun": """#!/bin/bash
out="$STUB_DIR/task$SLURM_NODEID"
printf '%s\\n' "$@" > "$out.args"
env | grep -E '^(NCCL|GLOO)_SOCKET_IFNAME=' | sort > "$out.env"
""",
}


def test_the_slurm_script_starts_one_agent_per_node_at_one_rendezvous(tmp_path: Path) -> None:
    script = DEPLOY / "slurm" / "train.sbatch"
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, f"bash -n train.sbatch: {check.stderr}"
    directives = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in directives, "one torchrun agent per node"
    for name, body in STUBS.items():
        path = tmp_path / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "STUB_DIR": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_NODELIST": "gpu-[007-009]",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "NCCL_SOCKET_IFNAME": "ens5",
    }
    run = subprocess.run(
        ["bash", str(script), "data.root=/lustre/imagenet"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert run.returncode == 0, f"train.sbatch with stubs failed:\n{run.stdout}\n{run.stderr}"
    assert "--frozen" in (tmp_path / "uv.sync").read_text(), "uv sync --frozen before srun"
    srun = (tmp_path / "srun.args").read_text().split()
    assert "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
    tasks = sorted(tmp_path.glob("task*.args"))
    if len(tasks) != 3:
        fail(f"train.sbatch: expected one torchrun per node (3), got {len(tasks)}\n{run.stdout}")
    for task in tasks:
        args = task.read_text().splitlines()
        command = ["torchrun", *args]
        what = f"train.sbatch, {task.stem}"
        rest = module_args(command, what)
        expected = {
            "nnodes": "3", "nproc-per-node": "8", "rdzv-backend": "c10d",
            "rdzv-endpoint": "gpu-007:29500", "rdzv-id": "4242", "max-restarts": "3",
        }  # fmt: skip
        got = {key: flag(command, key) for key in expected}
        if got != expected:
            fail(
                f"{what}: torchrun flags {got}, expected {expected} (command: {shlex.join(command)})"
            )
        cfg = trainer_config(rest)
        assert cfg.name == "resnet50-2node-16gpu" and cfg.data.root == "/lustre/imagenet"
        assert cfg.checkpoint.dir == f"{ROOT}/checkpoints/resnet50-2node-16gpu"
        task_env = dict(line.split("=", 1) for line in task.with_suffix(".env").read_text().split())
        assert task_env == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ens5"}, task_env
