//! `harpe sweep --executor slurm`: the `[slurm]` table and its bad input, the exact script `--dry-run`
//! prints (no cluster needed); and on the test cluster (scripts/slurm-test-cluster.sh) the 2-arm x 2-seed
//! tiny sweep of sweep.rs through one array job, with one task killed mid-run (SIGKILL: no checkpoint
//! of its own at the end) and recovered by running `harpe sweep` again, ending with the same report as the
//! local executor. README "The research workflow" lines covered: `harpe sweep --executor slurm ...`,
//! `harpe sweep --status ...`, `harpe report ...`.
use super::sweep::{harpe_in, has_checkpoint, setup, sweep_toml};
use crate::common::harpe_cmd;
use crate::common::slurm::{assert_readme_line, cluster, ended, run_ok, slurm_cmd, wait_job};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

const SLURM: &str = r#"
[slurm]
partition = "debug"
time = "00:20:00"
cpus_per_task = 1
set = ["dist.zero_stage=1"]
extra = ["--qos=normal"]
"#;

fn err(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn slurm_table_bad_input_names_the_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for (table, needle) in [
        ("[slurm]\npartitoin = \"gpu\"\n", "partitoin"),
        ("[slurm]\nnodes = 0\n", "`nodes` = 0"),
        ("[slurm]\ntime = \"1 day\"\n", "`time`"),
        ("[slurm]\nextra = [\"qos=long\"]\n", "\"qos=long\""),
        ("[slurm]\nnodes = \"two\"\n", "nodes"),
        ("[slurm]\nset = [\"optim.lr=1\"]\n", "\"optim.lr=1\" is not a `dist.KEY=VALUE`"),
    ] {
        setup(d, &sweep_toml(table));
        let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--executor", "slurm", "--dry-run"]);
        let e = err(&o);
        assert!(
            !o.status.success() && e.contains("sweep.toml") && e.contains(needle) && e.contains("hint:"),
            "{table}: {e}"
        );
    }
    // an arm's own table is checked the same way and named
    setup(d, &sweep_toml("").replace("name = \"harpe\"", "name = \"harpe\"\nslurm = { gpus_per_nod = 8 }"));
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--executor", "slurm", "--dry-run"]);
    assert!(!o.status.success() && err(&o).contains("gpus_per_nod"), "{}", err(&o));
    // a [dist] value that does not resolve stops the submission, not every task
    setup(d, &sweep_toml("[slurm]\nset = [\"dist.zero_stage=9\"]\n"));
    let o = harpe_in(d, &["sweep", "--config", "sweep.toml", "--executor", "slurm", "--dry-run"]);
    let e = err(&o);
    assert!(
        !o.status.success() && e.contains("[slurm] `set`") && e.contains("zero_stage") && e.contains("hint:"),
        "{e}"
    );
}

#[test]
fn slurm_dry_run_prints_one_array_script_per_shape_with_absolute_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().canonicalize().unwrap();
    // the harpe arm asks for 2 nodes x 8 GPUs: two shapes, two array jobs
    let toml = sweep_toml(SLURM).replace(
        "name = \"harpe\"",
        "name = \"harpe\"\nslurm = { nodes = 2, gpus_per_node = 8, time = \"72:00:00\", signal_lead_s = 1500 }",
    );
    setup(&d, &toml);
    let o = harpe_in(&d, &["sweep", "--config", "sweep.toml", "--out", "out", "--executor", "slurm", "--dry-run"]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", err(&o));
    assert!(text.contains("4 runs, 0 already done, 0 still queued, 4 to submit as 2 array job(s)"), "{text}");
    assert!(!d.join("out").exists(), "a dry run writes nothing");
    let scripts: Vec<&str> = text.split("# --- ").skip(1).collect();
    assert_eq!(scripts.len(), 2, "{text}");
    let out = d.join("out");
    let (rope, harpe) = (scripts[0], scripts[1]);
    // array index = position in the run list (rope seed 0, 1; harpe seed 0, 1)
    for line in [
        "#SBATCH --array=0,1",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --time=00:20:00",
        "#SBATCH --partition=debug",
        "#SBATCH --qos=normal",
        "#SBATCH --requeue",
        &format!("#SBATCH --output={}/slurm/%A_%a.out", out.display()),
        &format!("#SBATCH --chdir={}", d.display()),
        &format!("HARPE={}", env!("CARGO_BIN_EXE_harpe")),
        // the run's overrides, then [slurm]'s dist ones (how it is computed on the cluster)
        &format!(
            "  0) RUN=rope__seed0; CONFIG={}/base.toml; SET=(--set train.seed=0 --set dist.zero_stage=1) ;;",
            d.display()
        ),
        "srun --kill-on-bad-exit=1 \"$HARPE\" train --config \"$CONFIG\" --out \"$OUT/$RUN\" --resume \"${SET[@]}\"",
        &format!("\"$HARPE\" sweep --config {}/sweep.toml --out \"$OUT\" --task \"$RUN\"", d.display()),
    ] {
        assert!(rope.lines().any(|l| l.starts_with(line)), "missing `{line}` in\n{rope}");
    }
    assert!(!rope.contains("--gpus-per-node"), "{rope}");
    for line in [
        "#SBATCH --array=2,3",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=72:00:00",
        "#SBATCH --signal=TERM@1500",
        "  3) RUN=harpe__seed1;",
    ] {
        assert!(harpe.lines().any(|l| l.starts_with(line)), "missing `{line}` in\n{harpe}");
    }
    // the arm's override, quoted for the shell exactly as --set takes it
    assert!(
        harpe
            .contains(r#"SET=(--set 'rope={ scheme = "harpe", head_bases = [10000.0, 40000.0] }' --set train.seed=1 --set dist.zero_stage=1)"#),
        "{harpe}"
    );
    // the script is valid bash
    std::fs::write(d.join("s.sh"), harpe).unwrap();
    let o = std::process::Command::new("bash").arg("-n").arg(d.join("s.sh")).output().unwrap();
    assert!(o.status.success(), "{}", err(&o));
}

/// Metrics of report.json by arm, without the wall-clock ones (step times differ between any two runs).
fn report_metrics(dir: &Path) -> Value {
    let o = harpe_in(dir, &["report", "out", "--baseline", "rope", "--json"]);
    assert!(o.status.success(), "{}", err(&o));
    let mut v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut arms = vec![];
    for a in v["arms"].as_array_mut().unwrap() {
        let mut m = a["metrics"].as_object().unwrap().clone();
        m.retain(|k, _| !k.starts_with("cost:train_s"));
        let mut diff = a["diff"].as_object().cloned().unwrap_or_default();
        diff.retain(|k, _| !k.starts_with("cost:train_s"));
        arms.push(serde_json::json!({"arm": a["arm"], "metrics": m, "diff": diff}));
    }
    Value::Array(arms)
}

fn status(d: &Path, conf: &Path) -> String {
    let o = harpe_cmd().current_dir(d).env("SLURM_CONF", conf).args(["sweep", "--status", "out"]).output().unwrap();
    assert!(o.status.success(), "{}", err(&o));
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn row<'a>(status: &'a str, id: &str) -> Vec<&'a str> {
    status
        .lines()
        .find(|l| l.starts_with(&format!("{id} ")))
        .unwrap_or_else(|| panic!("{status}"))
        .split_whitespace()
        .collect()
}

/// Submit the sweep; the array job's id.
fn submit(d: &Path, conf: &Path, expect: &str) -> String {
    let o = harpe_cmd()
        .current_dir(d)
        .env("SLURM_CONF", conf)
        .args(["sweep", "--executor", "slurm", "--config", "sweep.toml", "--out", "out"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{text}{}", err(&o));
    assert!(text.contains(expect), "{text}");
    text.lines().find_map(|l| l.strip_prefix("submitted job ")).unwrap().split(':').next().unwrap().to_string()
}

#[test]
fn slurm_sweep_array_ends_with_the_local_report_and_a_killed_task_recovers() {
    let Some((conf, _one_at_a_time)) = cluster() else { return };
    let t0 = Instant::now();
    // the same sweep on the local executor
    let local = tempfile::tempdir().unwrap();
    setup(local.path(), &sweep_toml(SLURM.replace("extra = [\"--qos=normal\"]\n", "").as_str()));
    let o = harpe_in(local.path(), &["sweep", "--config", "sweep.toml", "--out", "out"]);
    assert!(o.status.success(), "{}", err(&o));
    let t_local = t0.elapsed();

    let t = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    setup(d, &sweep_toml(SLURM.replace("extra = [\"--qos=normal\"]\n", "").as_str()));
    // README's lines of the sweep on Slurm, with the tiny sweep for the paper's
    assert_readme_line(
        "harpe sweep --executor slurm --config configs/sweeps/harpe-vs-multistage.toml --out runs/hvm   # or on Slurm,",
    );
    assert_readme_line(
        "harpe sweep --status runs/hvm     # then per run: pending/running/done/failed, Slurm task id, last step",
    );
    assert_readme_line("harpe report runs/hvm --baseline abf-ms-32k-64k-128k");
    let job = submit(d, &conf, "4 to submit as 1 array job(s)");
    // SIGKILL the task of rope__seed1 (array index 1) once it has a checkpoint: a crash, not a clean stop
    let victim = d.join("out/rope__seed1");
    let t_wait = Instant::now();
    while !has_checkpoint(&victim) {
        assert!(t_wait.elapsed() < Duration::from_secs(300), "no checkpoint in {}", victim.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    run_ok(slurm_cmd(&conf, "scancel", d).args(["--signal=KILL", &format!("{job}_1")]));
    wait_job(&conf, &job, Duration::from_secs(600), ended);
    let st = status(d, &conf);
    let r = row(&st, "rope__seed1");
    assert_eq!(&r[1..3], ["failed", &format!("{job}_1")], "{st}");
    for id in ["rope__seed0", "harpe__seed0", "harpe__seed1"] {
        assert_eq!(row(&st, id)[1], "done", "{st}");
    }
    // README: harpe sweep --status runs/hvm, then the same sweep line again resubmits what is left
    let job2 = submit(d, &conf, "3 already done, 0 still queued, 1 to submit");
    wait_job(&conf, &job2, Duration::from_secs(300), ended);
    let st = status(d, &conf);
    let r = row(&st, "rope__seed1");
    assert_eq!(&r[1..3], ["done", &format!("{job2}_1")], "{st}");
    assert_eq!(r[4], "40", "{st}");
    assert!(std::fs::read_to_string(victim.join("train.log")).unwrap().contains("resuming from"));
    assert_eq!(std::fs::read_to_string(victim.join("metrics.jsonl")).unwrap().lines().count(), 40);
    // README: harpe report runs/hvm
    assert_eq!(report_metrics(d), report_metrics(local.path()), "the array's report is the local executor's");
    eprintln!(
        "timings: local sweep {:.1} s, slurm sweep with a kill and a resubmission {:.1} s",
        t_local.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn the_shipped_sweeps_submit_8_gpu_nccl_tasks_with_the_plans_stop_warning() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    for file in ["configs/sweeps/harpe-vs-multistage.toml", "configs/sweeps/data-strategies.toml"] {
        let o = harpe_cmd()
            .current_dir(root)
            .args(["sweep", "--config", file, "--executor", "slurm", "--dry-run", "--out"])
            .arg(out.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{file}: {}", err(&o));
        for line in ["#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8", "#SBATCH --signal=TERM@2880"] {
            assert!(text.lines().any(|l| l == line), "{file}: no `{line}` in\n{text}");
        }
        assert!(text.contains("--set dist.backend=nccl"), "{file}: {text}");
        // every arm of the 7B sweep at the layout that fits 128K (the arms' own recipes set no [dist])
        if file.ends_with("harpe-vs-multistage.toml") {
            assert!(text.contains("--set dist.zero_stage=3 --set dist.sp_degree=2) ;;"), "{file}: {text}");
        }
    }
    // 2880 is `harpe plan`'s stop line for the 128K recipe on one 8-GPU node at ZeRO-3 with harpe's attention
    // kernels (the slower ones: a build without flash-attn still gets its checkpoint written)
    let o = harpe_cmd()
        .current_dir(root)
        .args(["plan", "--config", "configs/harpe-128k.toml", "--set", "model.path=configs/arch/llama-2-7b"])
        .args(["--gpus", "8", "--zero", "3", "--set", "train.attention=\"harpe\""])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("-> Slurm --signal=TERM@2880"), "{}", err(&o));
}
