"""`sluice deploy render`: the committed examples equal a fresh render, bad input is
refused before anything is written, files are written as promised, and no password
reaches a manifest, a script or a command line. No Redis, no cluster: seconds."""

from __future__ import annotations

import itertools
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from pipeline.bus.keys import SCORERS_GROUP, Keys
from pipeline.bus.lanes import Lanes
from pipeline.bus.security import load_credentials_file
from pipeline.config import load_config
from sluice.cli import main
from sluice.deploy.files import MANIFEST, dump_toml
from sluice.deploy.plan import TARGETS, dns_name
from tests.deploy.examples import COMMITTED, EXAMPLES, RUNS, credentials, files, render_example

COPY = str(EXAMPLES["copy"])


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A fresh `sluice acl` per example run (and one for another run)."""
    root = tmp_path_factory.mktemp("acl")
    out = {ex: credentials(run, root / ex) for ex, run in RUNS.items()}
    out["other"] = credentials("someone-else", root / "other")
    return out


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_REDIS_CREDENTIALS_FILE", raising=False)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_committed_examples_equal_a_fresh_render(example: str, target: str, tmp_path: Path,
                                                 creds: dict[str, Path]) -> None:
    render_example(example, target, tmp_path / "out", creds[example])
    fresh, committed = files(tmp_path / "out"), files(COMMITTED / target / example)
    assert sorted(fresh) == sorted(committed), \
        "regenerate with `.venv/bin/python -m tests.deploy.examples`"
    for path, text in fresh.items():
        assert committed[path] == text, \
            f"{target}/{example}/{path} differs: `.venv/bin/python -m tests.deploy.examples`"


def _render(tmp_path: Path, target: str, *sets: str, creds: Path | None = None,
            config: str = COPY) -> tuple[int, Path]:
    out = tmp_path / "out"
    args = ["deploy", "render", config, "--target", target, "--out", str(out)]
    if creds is not None:
        args += ["--set", f"bus.credentials_file={creds}"]
    for s in sets:
        args += ["--set", s]
    return main(args), out


BAD = [
    ("compose", ["up.trainer_ranks=2"], "up.trainer_ranks"),
    ("k8s", ["generation.vllm.weight_transfer=nccl"], "generation.vllm.weight_transfer"),
    ("slurm", ["generation.engine=vllm", "generation.vllm.launch=3", "up.generators=2"],
     "generation.vllm.launch"),
    ("k8s", ["up.trainer_ranks=3", "deploy.trainer_nodes=2"], "deploy.trainer_nodes"),
    ("slurm", ["up.generators=3", "deploy.generator_nodes=2"], "deploy.generator_nodes"),
    ("k8s", ["deploy.redis=external"], "bus.redis_url"),
    ("k8s", ["deploy.redis=external", "bus.redis_url=unix:///tmp/r.sock"], "bus.redis_url"),
    ("compose", ["bus.redis_url=redis://redis.invalid:6379/0"], "deploy.redis"),
    ("k8s", ["run.output_dir=/scratch/copy"], "run.output_dir"),
    ("compose", ["run.output_dir=../copy"], "run.output_dir"),
    ("slurm", ["metrics.port=9100"], "metrics.port"),
    ("k8s", ["deploy.grace_s=10", "scoring.reward_timeout_s=30"], "deploy.grace_s"),
    ("k8s", ["deploy.scorers_min=5", "deploy.scorers_max=2"], "deploy"),
    ("k8s", ["deploy.scorers_min=0"], "deploy.scorers_min"),
    ("compose", ["up.generators=0"], "up.generators"),
    ("k8s", ["archive.enabled=true", "archive.path=/scratch/archive"], "archive.path"),
]


@pytest.mark.parametrize(("target", "sets", "key"), BAD)
def test_bad_input_exits_2_naming_the_key_and_writes_nothing(
        target: str, sets: list[str], key: str, tmp_path: Path, creds: dict[str, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _render(tmp_path, target, *sets, creds=creds["copy"])
    assert rc == 2
    assert key in capsys.readouterr().err
    assert not out.exists()


def test_acl_without_credentials_or_for_another_run_is_refused(
        tmp_path: Path, creds: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _render(tmp_path, "k8s")
    assert rc == 2 and "bus.credentials_file" in capsys.readouterr().err
    rc, out = _render(tmp_path, "slurm", creds=creds["other"])
    err = capsys.readouterr().err
    assert rc == 2 and "run.name" in err and "bus.credentials_file" in err
    assert not out.exists()
    rc, out = _render(tmp_path, "compose", "deploy.acl=false")  # no users: nothing needed
    assert rc == 0 and not (out / "secrets").exists()


def test_non_empty_out_is_refused_and_force_replaces_only_the_render(
        tmp_path: Path, creds: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    rc, _ = _render(tmp_path, "k8s", creds=creds["copy"])
    assert rc == 2 and "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    assert main(["deploy", "render", COPY, "--target", "k8s", "--out", str(out), "--force",
                 "--set", f"bus.credentials_file={creds['copy']}",
                 "--set", "deploy.autoscale=true"]) == 0
    assert (out / "keda.yaml").exists()
    # a second render without autoscaling no longer writes keda.yaml: it goes, mine stays
    assert main(["deploy", "render", COPY, "--target", "k8s", "--out", str(out), "--force",
                 "--set", f"bus.credentials_file={creds['copy']}",
                 "--set", "deploy.autoscale=false"]) == 0
    assert not (out / "keda.yaml").exists() and (out / "mine.txt").read_text() == "keep me"
    assert "keda.yaml" not in (out / MANIFEST).read_text()
    assert "keda.yaml" not in (out / "kustomization.yaml").read_text()
    secrets = out / "secrets"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in secrets.iterdir())
    assert not list(out.rglob(".*.tmp"))


@pytest.mark.parametrize("target", TARGETS)
def test_no_password_outside_secrets_and_run_toml_is_the_config(
        target: str, tmp_path: Path, creds: dict[str, Path]) -> None:
    rc, out = _render(tmp_path, target, "trainer.max_steps=7", creds=creds["copy"])
    assert rc == 0
    passwords = [c.password for c in load_credentials_file(creds["copy"]).values()]
    for rel, text in files(out).items():
        assert not any(p and p in text for p in passwords), f"a password in {rel}"
    for role_file in (out / "secrets").iterdir():  # each role's secret holds its user only
        if role_file.name != "users.acl":
            assert role_file.read_text().count("sluice-") == 1
    rendered = load_config(out / "run.toml")
    given = load_config(COPY, ["trainer.max_steps=7", f"bus.credentials_file={creds['copy']}"])
    replaced = ("bus", "metrics")  # where Redis is and who logs in: the target's to decide
    for section in type(given).model_fields:
        if section not in replaced:
            assert getattr(rendered, section) == getattr(given, section), section
    assert rendered.bus.credentials_file == ""
    assert rendered.trainer.max_steps == 7


def test_keda_watches_every_lane_of_the_scorers_stream(tmp_path: Path,
                                                      creds: dict[str, Path]) -> None:
    rc, out = _render(tmp_path, "k8s", "bus.partitions=3", "deploy.scorer_lag=30",
                      "deploy.autoscale=true", creds=creds["copy"])
    assert rc == 0
    docs = list(yaml.safe_load_all((out / "keda.yaml").read_text()))
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    trig = scaled["spec"]["triggers"]
    assert [t["metadata"]["stream"] for t in trig] == \
        Lanes(Keys("copy"), 3).streams("rollouts")
    assert {t["metadata"]["consumerGroup"] for t in trig} == {SCORERS_GROUP}
    assert {t["metadata"]["lagCount"] for t in trig} == {"10"}
    assert scaled["spec"]["scaleTargetRef"]["name"] == "sluice-copy-scorer"
    deployment = yaml.safe_load((out / "scorers.yaml").read_text())
    assert deployment["metadata"]["name"] == "sluice-copy-scorer"


def test_dump_toml_round_trips() -> None:
    data = {"a": 1, "b": "x \"q\" \\ é\n", "c": [1.5, 1e-06, True], "t": {
        "k": {"deep": [{"fn": "m:f", "weight": 0.0}]}, "empty": {}, "with space": 2}}
    assert tomllib.loads(dump_toml(data)) == data


def test_deploy_wait_times_out_naming_what_it_waited_for(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.ports import free_port

    url = f"http://127.0.0.1:{free_port()}/health"  # nothing listens there
    assert main(["deploy", "wait", COPY, "--http", url, "--timeout", "0.3"]) == 1
    assert url in capsys.readouterr().err
    assert main(["deploy", "wait", COPY]) == 2  # nothing to wait for


def test_an_object_store_reaches_the_weight_roles_from_a_secret_never_a_manifest(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """weights.store = s3://…: the trainer, generators and evaluator take the AWS_*
    variables from a Secret (k8s) or an env file (compose) the user writes; scorers,
    which never touch weights, do not; no credential value is rendered anywhere."""
    rc, out = _render(tmp_path / "k", "k8s", "weights.store=s3://bucket/run",
                      creds=creds["copy"])
    assert rc == 0
    refs: dict[str, list[str]] = {}
    for path in out.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {})
            pod = spec.get("template", {}).get("spec", {}) or spec.get("jobTemplate", {})
            for c in pod.get("containers", []) if isinstance(pod, dict) else []:
                refs[c["name"]] = [e["secretRef"]["name"] for e in c.get("envFrom", [])]
    name = dns_name(load_config(COPY).run.name)  # every object's prefix: sluice-<run>
    for role in ("trainer", "generator", "evaluator"):
        assert f"{name}-s3" in refs.get(role, []), (role, refs)
    assert f"{name}-s3" not in refs.get("scorer", []), refs
    rc, out = _render(tmp_path / "c", "compose", "weights.store=s3://bucket/run",
                      creds=creds["copy"])
    assert rc == 0
    services = yaml.safe_load((out / "compose.yaml").read_text())["services"]
    s3_env = {"path": "secrets/s3.env", "required": False}
    assert s3_env in services["trainer"]["env_file"]
    assert all(s3_env not in svc.get("env_file", []) for n, svc in services.items()
               if n.startswith("scorer"))


def test_an_archiving_run_places_one_archiver_with_its_own_redis_user(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """archive.enabled: the Slurm job runs one archiver, under its fixed name, beside Redis
    on the trainer's component, logged in as the archiver's Redis user (its own credentials
    file); a run without the archive renders none and needs no archiver user."""
    rc, out = _render(tmp_path / "a", "slurm", "archive.enabled=true", creds=creds["copy"])
    assert rc == 0
    script = (out / "sluice.sbatch").read_text()
    steps = [line for line in script.splitlines() if line.startswith("step ")]
    archivers = [line for line in steps if " archiver " in line]
    assert len(archivers) == 1 and archivers[0].startswith("step 0 ") and \
        " archiver-0 archiver " in archivers[0], steps
    assert (out / "secrets" / "archiver.toml").is_file()
    rc, out = _render(tmp_path / "b", "slurm", creds=creds["copy"])
    assert rc == 0
    assert " archiver" not in (out / "sluice.sbatch").read_text()
    assert not (out / "secrets" / "archiver.toml").exists()



SLURM_PLANS = {  # (example, --set overrides): the branches of the script's template
    "one host, no ACL": ("copy", ["deploy.acl=false"]),
    "external Redis": ("copy", ["deploy.redis=external",
                                "bus.redis_url=redis://redis.example:6380/2"]),
    "torchrun over two nodes": ("copy", ["up.trainer_ranks=4", "deploy.trainer_nodes=2",
                                         "trainer.device=cuda", "deploy.acl=false"]),
    "archive, partitions, time limit": ("copy", [
        "archive.enabled=true", "deploy.partition=cpu", "deploy.gpu_partition=gpu",
        "deploy.time_limit_min=120", "deploy.role_memory_gib=2.5"]),
    "vLLM and LoRA over two generator nodes": ("gsm8k", [
        "up.generators=2", "generation.vllm.launch=2", "deploy.generator_nodes=2",
        "model.lora.rank=8", "up.trainer_ranks=2", "deploy.scorers_with=generators",
        "deploy.exclusive=false", "deploy.requeue=false"]),
}


@pytest.mark.parametrize("plan", sorted(SLURM_PLANS))
def test_every_branch_of_the_slurm_template_renders_a_script_bash_parses(
        plan: str, tmp_path: Path, creds: dict[str, Path]) -> None:
    """The committed examples cover two plans; these cover the template's other branches:
    what comes out is one script bash parses, with no template syntax left, no blank line
    (a stray newline of the template) and every continued line continued."""
    example, sets = SLURM_PLANS[plan]
    rc, out = _render(tmp_path, "slurm", *sets, creds=creds[example],
                      config=str(EXAMPLES[example]))
    assert rc == 0
    script = (out / "sluice.sbatch").read_text()
    check = subprocess.run(["bash", "-n", str(out / "sluice.sbatch")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr
    assert not any(mark in script for mark in ("{{", "{%", "{#")), script
    lines = script.splitlines()
    assert "" not in lines and script.endswith("\n")
    for line, after in itertools.pairwise(lines):
        if line.endswith("\\"):
            assert after.startswith("  "), (line, after)
    if "torchrun" in plan:  # GPU ranks: their own GPUs and memory, never --overlap
        assert "srun --het-group=0 --nodes=2 --ntasks-per-node=1 --exact --cpus-per-task=" \
            in script
        assert "--nproc-per-node=2" in script and "--gpus-per-node=2 --mem=16384 \\" in script
