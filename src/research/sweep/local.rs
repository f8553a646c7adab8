//! The local executor: every run a `harpe train` child process of this sweep, `--jobs` at a time, then
//! its evaluations as `harpe eval-*` children; a stop signal is forwarded once so every child
//! checkpoints and a rerun resumes. A Slurm array task evaluates its run with the same code (`Ctx`
//! with `shared`), so both executors write the same evaluation files.
use super::args::SweepArgs;
use super::index::{check_run_dir, load_index, new_entry, run_finished, update_index, write_marker};
use super::index::{RunEntry, RunState, SweepIndex, INDEX_FORMAT};
use super::spec::{sanitize, EvalSpec, RunPlan, SweepSpec};
use crate::config::RunConfig;
use crate::train::RunDir;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `harpe` binary that runs the children: `$HARPE_BIN`, else this executable.
pub fn harpe_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("HARPE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()
        .context("cannot locate the running executable\nhint: set HARPE_BIN to the harpe binary")?;
    let stem = exe.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    if stem != "harpe" {
        bail!("{} is not the harpe binary (sweeps start `harpe train` processes)\nhint: set HARPE_BIN to the harpe binary", exe.display());
    }
    Ok(exe)
}

/// Shared state of a running sweep.
pub(super) struct Ctx {
    pub(super) bin: PathBuf,
    pub(super) out: PathBuf,
    pub(super) name: String,
    pub(super) eval: EvalSpec,
    pub(super) threads: Option<usize>,
    pub(super) index: Mutex<SweepIndex>,
    pub(super) stop: Arc<AtomicBool>,
    /// other processes (Slurm array tasks) write sweep.json too: merge this run's entry into the file
    pub(super) shared: bool,
}

impl Ctx {
    pub(super) fn update(&self, id: &str, f: impl FnOnce(&mut RunEntry)) -> Result<()> {
        let mut ix = self.index.lock().map_err(|_| anyhow!("internal: sweep index lock poisoned"))?;
        if let Some(e) = ix.runs.iter_mut().find(|e| e.id == id) {
            f(e);
        }
        if self.shared {
            let mine = ix.runs.iter().find(|e| e.id == id).cloned();
            return update_index(&self.out, &ix.clone(), |disk| {
                if let Some(e) = mine {
                    match disk.runs.iter_mut().find(|d| d.id == e.id) {
                        Some(d) => *d = e,
                        None => disk.runs.push(e),
                    }
                }
            });
        }
        let text = serde_json::to_string_pretty(&*ix)?;
        crate::util::write_atomic(&self.out.join("sweep.json"), text.as_bytes())
    }

    fn command(&self, args: &[String]) -> Command {
        let mut c = Command::new(&self.bin);
        c.args(args).stdin(Stdio::null());
        if let Some(n) = self.threads {
            if std::env::var_os("RAYON_NUM_THREADS").is_none() {
                c.env("RAYON_NUM_THREADS", n.to_string());
            }
        }
        // own process group: a terminal's Ctrl-C reaches the sweep only, which forwards one SIGTERM
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            c.process_group(0);
            #[cfg(target_os = "linux")]
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                c.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        c
    }

    /// Run a child to completion with stdout (or `capture`) and stderr going to `log`; forward a stop.
    fn run_child(&self, args: &[String], log: &Path, capture: bool) -> Result<(bool, String)> {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let mut cmd = self.command(args);
        cmd.stderr(logf.try_clone()?);
        if capture {
            cmd.stdout(Stdio::piped());
        } else {
            cmd.stdout(logf);
        }
        let mut child: Child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}\nhint: set HARPE_BIN to the harpe binary", self.bin.display()))?;
        let mut out = String::new();
        let reader = child.stdout.take().map(|mut s| {
            std::thread::spawn(move || {
                let mut buf = String::new();
                let _ = std::io::Read::read_to_string(&mut s, &mut buf);
                buf
            })
        });
        let mut forwarded = false;
        let status = loop {
            if let Some(st) = child.try_wait()? {
                break st;
            }
            if self.stop.load(Ordering::SeqCst) && !forwarded {
                forwarded = true;
                #[cfg(unix)]
                // SAFETY: kill(2) on our own child's pid; no memory is touched.
                unsafe {
                    libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(r) = reader {
            out = r.join().map_err(|_| anyhow!("internal: output reader panicked"))?;
        }
        Ok((status.success(), out))
    }
}

fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Train (or resume) one run; Ok(false) when it stopped before the end (signal).
fn train_run(ctx: &Ctx, plan: &RunPlan, dir: &Path) -> Result<bool> {
    if run_finished(dir, plan.resolved.stages.len())? {
        return Ok(true);
    }
    let mut args = vec!["train".into(), "--config".into(), s(&plan.config), "--out".into(), s(dir), "--resume".into()];
    for o in &plan.set {
        args.push("--set".into());
        args.push(o.clone());
    }
    let log = RunDir::new(dir).train_log();
    let t0 = Instant::now();
    let (ok, _) = ctx.run_child(&args, &log, false)?;
    let dt = t0.elapsed().as_secs_f64();
    ctx.update(&plan.id, |e| e.train_s += dt)?;
    if !ok {
        bail!("harpe train failed:\n{}\nhint: see {} (rerun the sweep to retry)", tail(&log, 15), log.display());
    }
    run_finished(dir, plan.resolved.stages.len())
}

/// Run one evaluation command unless its output exists; Ok(false) when stopped.
fn eval_step(ctx: &Ctx, dir: &Path, out: &Path, args: Vec<String>, capture: bool) -> Result<bool> {
    if out.exists() {
        return Ok(true);
    }
    if ctx.stop.load(Ordering::SeqCst) {
        return Ok(false);
    }
    let log = RunDir::new(dir).eval_log();
    let (ok, stdout) = ctx.run_child(&args, &log, capture)?;
    if !ok {
        if ctx.stop.load(Ordering::SeqCst) {
            return Ok(false);
        }
        bail!("harpe {} failed:\n{}\nhint: see {}", args[0], tail(&log, 15), log.display());
    }
    if capture {
        let v: serde_json::Value = serde_json::from_str(stdout.trim())
            .map_err(|e| anyhow!("harpe {} printed no JSON ({e})\nhint: see {}", args[0], log.display()))?;
        crate::util::write_atomic(out, serde_json::to_string_pretty(&v)?.as_bytes())?;
    }
    Ok(true)
}

/// Evaluate a finished run as `[eval]` says; writes `eval/*.json` and `eval/summary.json`.
pub(super) fn eval_run(ctx: &Ctx, dir: &Path) -> Result<bool> {
    let ckpt = RunDir::new(dir)
        .latest_checkpoint()?
        .ok_or_else(|| anyhow!("{}: no complete checkpoint to evaluate\nhint: rerun the sweep", dir.display()))?;
    let ev = RunDir::new(dir).eval_dir();
    std::fs::create_dir_all(&ev).with_context(|| format!("cannot create {}", ev.display()))?;
    let model = s(&ckpt);
    for p in &ctx.eval.ppl {
        let mut a = vec!["eval-ppl".into(), "--model".into(), model.clone(), "--json".into()];
        a.extend(["--window".into(), p.window.to_string(), "--stride".into(), p.stride.to_string()]);
        if let Some(m) = p.max_tokens {
            a.extend(["--max-tokens".into(), m.to_string()]);
        }
        a.push("--input".into());
        a.extend(p.input.iter().map(|i| s(i)));
        if !eval_step(ctx, dir, &ev.join(format!("ppl-{}.json", sanitize(&p.name))), a, true)? {
            return Ok(false);
        }
    }
    if let Some(l) = &ctx.eval.loss {
        let buckets: Vec<String> = l.buckets.iter().map(usize::to_string).collect();
        let mut a =
            vec!["eval-loss".into(), "--model".into(), model.clone(), "--json".into(), "--data".into(), s(&l.data)];
        a.extend(["--buckets".into(), buckets.join(",")]);
        if let Some(m) = l.max_sequences {
            a.extend(["--max-sequences".into(), m.to_string()]);
        }
        if !eval_step(ctx, dir, &RunDir::new(dir).eval_loss(), a, true)? {
            return Ok(false);
        }
    }
    if let Some(n) = &ctx.eval.niah {
        let out = RunDir::new(dir).eval_niah();
        let lengths: Vec<String> = n.lengths.iter().map(usize::to_string).collect();
        let mut a = vec![
            "eval-niah".into(),
            "--model".into(),
            model,
            "--out".into(),
            s(&out),
            "--tasks".into(),
            n.tasks.clone(),
        ];
        a.extend(["--lengths".into(), lengths.join(","), "--samples".into(), n.samples.to_string()]);
        if let Some(e) = &n.essays {
            a.extend(["--essays".into(), s(e)]);
        }
        if let Some(d) = n.passkey_depths {
            a.extend(["--passkey-depths".into(), d.to_string()]);
        }
        if n.force {
            a.push("--force".into());
        }
        if !eval_step(ctx, dir, &out.join("results.json"), a, false)? {
            return Ok(false);
        }
    }
    let summary = eval_summary(&ev, &ctx.eval)?;
    crate::util::write_atomic(&RunDir::new(dir).eval_summary(), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    Ok(true)
}

/// Flatten a run's evaluation outputs into `metric -> value`: `ppl:<name>`, `nll:<name>`,
/// `loss:<bucket>`, `loss:total`, `<task>@<length>` (score 0-100).
pub fn eval_summary(ev: &Path, spec: &EvalSpec) -> Result<BTreeMap<String, f64>> {
    let read = |p: &Path| -> Result<serde_json::Value> {
        let t = std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?;
        serde_json::from_str(&t).map_err(|e| anyhow!("{}: {e}\nhint: remove it to re-evaluate", p.display()))
    };
    let num = |v: &serde_json::Value, k: &str, p: &Path| -> Result<f64> {
        v.get(k)
            .and_then(|x| x.as_f64())
            .ok_or_else(|| anyhow!("{}: no number `{k}`\nhint: remove it to re-evaluate", p.display()))
    };
    let mut m = BTreeMap::new();
    for p in &spec.ppl {
        let f = ev.join(format!("ppl-{}.json", sanitize(&p.name)));
        let v = read(&f)?;
        m.insert(format!("ppl:{}", p.name), num(&v, "ppl", &f)?);
        m.insert(format!("nll:{}", p.name), num(&v, "nll", &f)?);
    }
    if spec.loss.is_some() {
        let f = ev.join("loss.json");
        let v = read(&f)?;
        if let Some(b) = v.get("by_bucket").and_then(|b| b.as_object()) {
            for (k, cell) in b {
                m.insert(format!("loss:{k}"), num(cell, "loss", &f)?);
            }
        }
        if let Some(t) = v.get("total") {
            m.insert("loss:total".into(), num(t, "loss", &f)?);
        }
    }
    if spec.niah.is_some() {
        let f = ev.join("niah").join("results.json");
        let v = read(&f)?;
        for c in v.get("cells").and_then(|c| c.as_array()).into_iter().flatten() {
            let task = c.get("task").and_then(|t| t.as_str()).unwrap_or("?");
            let len = c.get("length").and_then(|t| t.as_u64()).unwrap_or(0);
            m.insert(format!("{task}@{len}"), num(c, "score", &f)?);
        }
    }
    Ok(m)
}

/// Train and evaluate one run; returns its final state.
fn do_run(ctx: &Ctx, plan: &RunPlan) -> Result<RunState> {
    let dir = write_marker(&ctx.out, &ctx.name, &ctx.eval, plan)?;
    let resuming = RunDir::new(&dir).latest_checkpoint()?.is_some();
    ctx.update(&plan.id, |e| {
        e.state = RunState::Training;
        e.attempts += 1;
        e.error = None;
    })?;
    println!("[sweep] {} {}", if resuming { "resume" } else { "train " }, plan.id);
    if !train_run(ctx, plan, &dir)? {
        ctx.update(&plan.id, |e| e.state = RunState::Interrupted)?;
        return Ok(RunState::Interrupted);
    }
    ctx.update(&plan.id, |e| e.state = RunState::Evaluating)?;
    let t0 = Instant::now();
    let done = eval_run(ctx, &dir)?;
    let dt = t0.elapsed().as_secs_f64();
    let state = if done { RunState::Done } else { RunState::Interrupted };
    ctx.update(&plan.id, |e| {
        e.eval_s += dt;
        e.state = state;
    })?;
    println!("[sweep] {} {}", if done { "done  " } else { "stopped" }, plan.id);
    Ok(state)
}

/// Print the plan and its cost.
pub(super) fn print_plan(plans: &[RunPlan], args: &SweepArgs) {
    println!("{:<48} {:>6} {:>14} {:>12}  stages (seq_len x tokens)", "run", "seed", "tokens", "est. GPU-h");
    let mut total_tokens = 0u64;
    let mut total_h = 0.0;
    let mut have_cost = true;
    for p in plans {
        let c = &p.resolved;
        let mut tokens = 0u64;
        let mut flops = 0.0;
        let arch = model_arch(c);
        let mut stages = vec![];
        for i in 0..c.stages.len() {
            let (steps, per) = c.stage_steps(i);
            tokens += steps * per;
            stages.push(format!("{}x{}", c.stages[i].seq_len, crate::util::human_count(steps * per)));
            if let Some(m) = &arch {
                flops += (steps * per) as f64
                    * crate::model::flops_per_token(
                        m.num_params(),
                        m.num_hidden_layers,
                        m.hidden_size,
                        c.stages[i].seq_len,
                    );
            }
        }
        let peak = args.peak_tflops.unwrap_or(if c.log.peak_tflops > 0.0 { c.log.peak_tflops } else { 312.0 });
        let hours = flops / (peak * 1e12 * args.mfu) / 3600.0;
        have_cost &= arch.is_some();
        total_tokens += tokens;
        total_h += hours;
        let h = if arch.is_some() { format!("{hours:.0}") } else { "?".into() };
        println!(
            "{:<48} {:>6} {:>14} {:>12}  {}",
            p.id,
            p.seed,
            crate::util::human_count(tokens),
            h,
            stages.join(" -> ")
        );
    }
    println!(
        "{} runs, {} tokens, {} GPU-hours at {:.0}% MFU (6N + 12LCT FLOPs per token, no recompute){}",
        plans.len(),
        crate::util::human_count(total_tokens),
        if have_cost { format!("{total_h:.0}") } else { "?".into() },
        args.mfu * 100.0,
        if have_cost { "" } else { "; ? = the model's config.json is not readable here" }
    );
}

fn model_arch(c: &RunConfig) -> Option<crate::model::config::LlamaConfig> {
    if let Some(p) = &c.model.path {
        return crate::model::config::LlamaConfig::from_file(&p.join("config.json")).ok();
    }
    let a = c.model.init.as_ref()?;
    let rope = crate::model::rope::RopeScheme::Default { theta: 10000.0 };
    let mut m = crate::model::config::LlamaConfig::tiny(a.vocab_size, rope);
    m.hidden_size = a.hidden_size;
    m.intermediate_size = a.intermediate_size;
    m.num_hidden_layers = a.num_hidden_layers;
    m.num_attention_heads = a.num_attention_heads;
    m.num_key_value_heads = a.num_key_value_heads.unwrap_or(a.num_attention_heads);
    m.head_dim = a.head_dim.unwrap_or(a.hidden_size / a.num_attention_heads);
    m.tie_word_embeddings = a.tie_word_embeddings;
    Some(m)
}

/// Train and evaluate the planned runs here, `--jobs` at a time; runs already done are skipped.
pub(super) fn run(args: &SweepArgs, config: &Path, spec: &SweepSpec, name: &str, plans: Vec<RunPlan>) -> Result<()> {
    if args.jobs == 0 {
        bail!("--jobs 0: nothing would run\nhint: --jobs 1 runs one after another");
    }
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(sanitize(name)));
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create {}\nhint: choose a writable --out", out.display()))?;
    let old = load_index(&out, name)?;
    for p in &plans {
        check_run_dir(&out.join(&p.id), name, p)?;
    }
    let mut old_runs: BTreeMap<String, RunEntry> =
        old.map(|ix| ix.runs.into_iter().map(|r| (r.id.clone(), r)).collect()).unwrap_or_default();
    let mut runs = vec![];
    let mut queue = VecDeque::new();
    for (i, p) in plans.iter().enumerate() {
        let mut e = old_runs.get(&p.id).cloned().unwrap_or_else(|| new_entry(p));
        let complete = e.state == RunState::Done && RunDir::new(out.join(&p.id)).eval_summary().exists();
        if !complete {
            if e.state == RunState::Done {
                e.state = RunState::Pending;
            }
            queue.push_back(i);
        }
        runs.push(e);
    }
    // runs outside --only stay in the index as they were
    for p in &plans {
        old_runs.remove(&p.id);
    }
    runs.extend(old_runs.into_values());
    let jobs = args.jobs.min(queue.len()).max(1);
    announce(name, spec, &plans, queue.len(), jobs, &out);
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let ctx = Ctx {
        bin: harpe_binary()?,
        out: out.clone(),
        name: name.to_string(),
        eval: spec.eval.clone(),
        threads: (jobs > 1).then(|| (cores / jobs).max(1)),
        index: Mutex::new(SweepIndex {
            format: INDEX_FORMAT.into(),
            name: name.to_string(),
            spec: config.to_path_buf(),
            eval: spec.eval.clone(),
            runs,
        }),
        stop: Arc::clone(&stop),
        shared: false,
    };
    ctx.update("", |_| {})?;
    let failures = run_queue(&ctx, &plans, queue, jobs)?;
    let ix = ctx.index.into_inner().map_err(|_| anyhow!("internal: lock poisoned"))?;
    outcome(name, &out, &ix, stop.load(Ordering::SeqCst), &failures)
}

/// The sweep's one-line plan: runs, arms, seeds, how many are done and to go, and where.
fn announce(name: &str, spec: &SweepSpec, plans: &[RunPlan], to_go: usize, jobs: usize, out: &Path) {
    let skipped = plans.len() - to_go;
    println!(
        "sweep `{name}`: {} runs ({} arms x grid x {} seeds), {skipped} already done, {to_go} to go, {jobs} at a time -> {}",
        plans.len(),
        plans.iter().map(|p| p.group.as_str()).collect::<BTreeSet<_>>().len(),
        spec.seeds.len(),
        out.display()
    );
}

/// Run the queued plans on `jobs` worker threads until the queue is empty or a stop; the failed runs' ids and errors.
fn run_queue(ctx: &Ctx, plans: &[RunPlan], queue: VecDeque<usize>, jobs: usize) -> Result<Vec<(String, String)>> {
    let queue = Mutex::new(queue);
    let failures: Mutex<Vec<(String, String)>> = Mutex::new(vec![]);
    std::thread::scope(|sc| {
        for _ in 0..jobs {
            sc.spawn(|| loop {
                if ctx.stop.load(Ordering::SeqCst) {
                    break;
                }
                let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                let Some(i) = next else { break };
                let plan = &plans[i];
                if let Err(e) = do_run(ctx, plan) {
                    let msg = format!("{e:#}");
                    eprintln!("[sweep] FAILED {}: {msg}", plan.id);
                    let _ = ctx.update(&plan.id, |r| {
                        r.state = RunState::Failed;
                        r.error = Some(msg.clone());
                    });
                    if let Ok(mut f) = failures.lock() {
                        f.push((plan.id.clone(), msg));
                    }
                }
            });
        }
    });
    failures.into_inner().map_err(|_| anyhow!("internal: lock poisoned"))
}

/// The sweep's end: stopped by a signal, some runs failed, or all done.
fn outcome(name: &str, out: &Path, ix: &SweepIndex, stopped: bool, failures: &[(String, String)]) -> Result<()> {
    let done = ix.runs.iter().filter(|r| r.state == RunState::Done).count();
    if stopped {
        bail!(
            "sweep stopped by a signal: {done}/{} runs done, the others checkpointed\nhint: rerun the same command to resume",
            ix.runs.len()
        );
    }
    if !failures.is_empty() {
        let list: Vec<String> =
            failures.iter().map(|(id, m)| format!("  {id}: {}", m.lines().next().unwrap_or(""))).collect();
        bail!(
            "{} of {} runs failed:\n{}\nhint: see each run's train.log / eval.log; rerun the same command to retry them",
            failures.len(),
            ix.runs.len(),
            list.join("\n")
        );
    }
    println!("sweep `{name}`: all {done} runs done; next: harpe report {}", out.display());
    Ok(())
}
