//! A two-node Slurm cluster on this machine, for the tests of README's 2-node srun and sbatch lines: the
//! two hosts of tests/common/netns.rs (node01, node02), `slurmctld` and one `slurmd` on node01, a second
//! `slurmd` on node02, one `munged` for both, all under a directory of their own
//! (/tmp/harpe-slurm-2n-<pid>-<n>) and ended, with every process left in the two namespaces, on `Drop`,
//! also when the test panics.
//!
//! Debian's slurmd is built without multiple-slurmd support, so one machine cannot run two of them in one
//! network; each runs in its own namespace, under its own host name, with `NodeAddr` its address on the
//! link. The daemons enter the namespaces with `nsenter` rather than `ip netns exec`, which would hide the
//! cgroup mounts slurmd needs. munged listens on a socket file, which both namespaces reach
//! (`AuthInfo=socket=...`). The one-node cluster of scripts/slurm-test-cluster.sh, if up, is not touched:
//! its ports are in the machine's own network namespace. Cannot be made (not root, no slurm-wlm): the
//! test is skipped with a message, or fails under CI.
use super::netns::{Hosts, Names, NAMES};
use crate::common::slurm::{one_at_a_time, squeue_state};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

/// The running cluster: its slurm.conf, daemons and hosts.
pub struct TwoNodes {
    dir: PathBuf,
    conf: PathBuf,
    daemons: Vec<(&'static str, Child)>,
    hosts: Hosts,
    _one_at_a_time: MutexGuard<'static, ()>,
}

fn under_ci() -> bool {
    std::env::var("HARPE_CI").is_ok_and(|v| v == "1")
}

impl TwoNodes {
    /// The cluster with both nodes idle, or `None` (after printing why) when it cannot be made outside CI.
    pub fn up(test: &str) -> Option<TwoNodes> {
        let missing: Vec<&str> = ["slurmctld", "slurmd", "munged", "srun", "sbatch", "nsenter"]
            .into_iter()
            .filter(|p| {
                !Command::new("sh").args(["-c", &format!("command -v {p}")]).output().is_ok_and(|o| o.status.success())
            })
            .collect();
        if !missing.is_empty() {
            let why = format!("{} not installed (apt-get install slurm-wlm munge)", missing.join(", "));
            assert!(!under_ci(), "{test}: cannot make the two-node Slurm cluster under CI: {why}");
            eprintln!("SKIPPED {test}: {why}");
            return None;
        }
        let guard = one_at_a_time();
        let hosts = Hosts::make(test, Names::Cluster)?;
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir =
            PathBuf::from(format!("/tmp/harpe-slurm-2n-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst)));
        let conf = dir.join("slurm.conf");
        let mut c = TwoNodes { dir, conf, daemons: Vec::new(), hosts, _one_at_a_time: guard };
        match c.start() {
            Ok(()) => Some(c),
            Err(why) => {
                let why = format!("{why}\n{}", c.logs());
                assert!(!under_ci(), "{test}: cannot make the two-node Slurm cluster under CI: {why}");
                eprintln!("SKIPPED {test}: cannot make the two-node Slurm cluster: {why}");
                None
            }
        }
    }

    fn start(&mut self) -> Result<(), String> {
        let d = self.dir.clone();
        // a directory of an earlier process with this pid (killed before its Drop) would hold its key
        let _ = std::fs::remove_dir_all(&d);
        for sub in ["state", "munge", "spool-node01", "spool-node02"] {
            std::fs::create_dir_all(d.join(sub)).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        let mut key = [0u8; 128];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").map_err(|e| e.to_string())?, &mut key)
            .map_err(|e| format!("/dev/urandom: {e}"))?;
        write_private(&d.join("munge/munge.key"), &key)?;
        let socket = d.join("munge/munge.socket");
        let mut munged = Command::new("munged");
        munged.arg("--foreground").arg("--force").arg(format!("--key-file={}", d.join("munge/munge.key").display()));
        munged
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--seed-file={}", d.join("munge/seed").display()));
        munged.arg(format!("--pid-file={}", d.join("munged.pid").display()));
        self.spawn("munged", munged)?;
        std::fs::write(&self.conf, self.conf_text(&socket)?).map_err(|e| format!("{}: {e}", self.conf.display()))?;
        let mut ctld = self.hosts.cmd_keeping_sys(0, "slurmctld");
        ctld.arg("-D").arg("-f").arg(&self.conf);
        self.spawn("slurmctld", ctld)?;
        for (i, name) in NAMES.iter().enumerate() {
            let mut slurmd = self.hosts.cmd_keeping_sys(i, "slurmd");
            slurmd.arg("-D").arg("-f").arg(&self.conf).args(["-N", name]);
            self.spawn(if i == 0 { "slurmd-node01" } else { "slurmd-node02" }, slurmd)?;
        }
        let t0 = Instant::now();
        loop {
            let o =
                self.cmd("sinfo", &d).args(["-h", "-N", "-o", "%N %t"]).output().map_err(|e| format!("sinfo: {e}"))?;
            let text = String::from_utf8_lossy(&o.stdout).to_string();
            if text.lines().filter(|l| l.ends_with(" idle")).count() == 2 {
                eprintln!("two-node Slurm cluster up in {:.1} s ({})", t0.elapsed().as_secs_f64(), d.display());
                return Ok(());
            }
            if let Some(name) = self.daemons.iter_mut().find_map(|(n, c)| c.try_wait().ok().flatten().map(|_| *n)) {
                return Err(format!("{name} exited"));
            }
            if t0.elapsed() > Duration::from_secs(30) {
                return Err(format!("the nodes are not idle after 30 s: {}", text.trim()));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// slurm.conf: both nodes with this machine's CPUs and memory (`slurmd -C`), each at its address on the
    /// link, a spool directory, pid and log file per node (`%n`: the node's name); otherwise the choices of
    /// scripts/slurm-test-cluster.sh.
    fn conf_text(&self, socket: &Path) -> Result<String, String> {
        let o = Command::new("slurmd").arg("-C").output().map_err(|e| format!("slurmd -C: {e}"))?;
        let first = String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or_default().to_string();
        let hw = first.split_once(' ').map(|(_, hw)| hw.to_string()).ok_or(format!("slurmd -C printed `{first}`"))?;
        let d = self.dir.display();
        let mut s = format!(
            "ClusterName=harpe-2n\nSlurmctldHost={}({})\nSlurmUser=root\nSlurmdUser=root\n\
             AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={}\nStateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool-%n\nSlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd-%n.log\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\nMpiDefault=none\nJobRequeue=1\nReturnToService=2\n\
             AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n\
             JobCompType=jobcomp/none\nMinJobAge=600\nSchedulerParameters=sched_interval=2\n",
            NAMES[0],
            self.hosts.addr(0),
            socket.display()
        );
        for (i, name) in NAMES.iter().enumerate() {
            s.push_str(&format!("NodeName={name} NodeAddr={} {hw} State=UNKNOWN\n", self.hosts.addr(i)));
        }
        s.push_str("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n");
        Ok(s)
    }

    fn spawn(&mut self, name: &'static str, mut cmd: Command) -> Result<(), String> {
        let out = std::fs::File::create(self.dir.join(format!("{name}.out"))).map_err(|e| e.to_string())?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().map_err(|e| format!("{name}: {e}"))?;
        self.daemons.push((name, child));
        Ok(())
    }

    /// `prog` as a command on node01 with the cluster's `SLURM_CONF`, run in `dir`.
    pub fn cmd(&self, prog: &str, dir: &Path) -> Command {
        let mut c = self.hosts.cmd(0, prog);
        c.env("SLURM_CONF", &self.conf).current_dir(dir);
        c
    }

    /// squeue's state of job `id` ("" once it left the queue).
    pub fn job_state(&self, id: &str) -> String {
        squeue_state(self.cmd("squeue", Path::new("/")), id)
    }

    /// The tail of every daemon's log, for a failure message.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for name in ["munged.out", "slurmctld.log", "slurmd-node01.log", "slurmd-node02.log"] {
            let text = std::fs::read_to_string(self.dir.join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            s.push_str(&format!("--- {name}\n{}\n", lines[lines.len().saturating_sub(15)..].join("\n")));
        }
        s
    }
}

/// Write `bytes` to `path`, readable by its owner only (munged refuses a key others can read).
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o400).open(path);
    f.as_mut().map_err(|e| format!("{}: {e}", path.display()))?.write_all(bytes).map_err(|e| e.to_string())
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a pid this fixture started (a daemon or a process in its namespaces).
    unsafe { libc::kill(pid as i32, sig) };
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        let _ = self.cmd("scancel", Path::new("/")).arg("--user=root").output();
        // slurmd before slurmctld before munged; then anything left in the namespaces (a job step's
        // slurmstepd or task), so deleting them leaves no process behind
        for (_, child) in self.daemons.iter_mut().rev() {
            signal(child.id(), libc::SIGTERM);
            let t0 = Instant::now();
            while child.try_wait().ok().flatten().is_none() && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        for i in 0..2 {
            for pid in self.hosts.pids(i) {
                signal(pid, libc::SIGKILL);
            }
        }
        if std::thread::panicking() {
            eprintln!("the two-node Slurm cluster's files are kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
