//! Two hosts on one machine, for the multi-node tests: two network namespaces joined by a veth pair, each
//! with its own address in a private /24 of 10.77.0.0/16, loopback up, its own host name (every command
//! runs under `unshare --uts` after `hostname`) and its own /etc/hosts (`ip netns exec` bind-mounts
//! /etc/netns/<namespace>/hosts over it), naming both hosts as a cluster's DNS would — or, with
//! `Names::OwnNameLoopback`, mapping each host's own name to 127.0.1.1 as Debian's default /etc/hosts
//! does.
//!
//! The namespaces have no link to the machine's own network and no route beyond their /24, so no test
//! traffic leaves them. `Drop` deletes them (the veth pair goes with them) and the hosts files, also when
//! the test panics. Root only: without it the test is skipped with a message; under CI (`HARPE_CI` or
//! `CI` set) a fixture that cannot be made is a failure.
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// How each host's /etc/hosts names the hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    /// Every host name maps to that host's address on the link.
    Cluster,
    /// As `Cluster`, but a host's own name maps to 127.0.1.1 on that host (Debian's default).
    OwnNameLoopback,
}

/// Two hosts, `node01` (index 0) and `node02` (index 1).
pub struct Hosts {
    ns: [String; 2],
    veth: [String; 2],
    addrs: [String; 2],
}

/// The host names, as the hosts' own `hostname` and /etc/hosts spell them.
pub const NAMES: [&str; 2] = ["node01", "node02"];

fn under_ci() -> bool {
    ["HARPE_CI", "CI"].iter().any(|k| std::env::var(k).is_ok_and(|v| !v.is_empty() && v != "0" && v != "false"))
}

/// Run `ip ARGS`; the error text when it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    match Command::new("ip").args(args).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => Err(format!("ip: {e} (is iproute2 installed?)")),
    }
}

impl Hosts {
    /// The two hosts, or `None` (after printing why) when they cannot be made outside CI.
    pub fn make(test: &str, names: Names) -> Option<Hosts> {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}{n}", std::process::id());
        // a distinct /24 per fixture, though namespaces apart would not collide anyway
        let net = format!("10.77.{}", (std::process::id() as usize * 7 + n) % 250 + 1);
        let h = Hosts {
            ns: [format!("harpe-{tag}a"), format!("harpe-{tag}b")],
            veth: [format!("hv{tag}a"), format!("hv{tag}b")],
            addrs: [format!("{net}.1"), format!("{net}.2")],
        };
        match h.build(names) {
            Ok(()) => Some(h),
            Err(why) => {
                drop(h);
                assert!(!under_ci(), "{test}: cannot make two network namespaces under CI ({why}); CI runs as root");
                eprintln!("SKIPPED {test}: cannot make two network namespaces ({why}); run as root to test two hosts");
                None
            }
        }
    }

    fn build(&self, names: Names) -> Result<(), String> {
        if self.veth.iter().any(|v| v.len() > 15) {
            return Err(format!("interface names {:?} are over 15 characters", self.veth));
        }
        for ns in &self.ns {
            ip(&["netns", "add", ns])?;
        }
        ip(&["link", "add", &self.veth[0], "type", "veth", "peer", "name", &self.veth[1]])?;
        for i in 0..2 {
            let (ns, v) = (&self.ns[i], &self.veth[i]);
            ip(&["link", "set", v, "netns", ns])?;
            ip(&["-n", ns, "addr", "add", &format!("{}/24", self.addrs[i]), "dev", v])?;
            ip(&["-n", ns, "link", "set", v, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            let mut hosts = String::from("127.0.0.1 localhost\n");
            for (j, name) in NAMES.iter().enumerate() {
                let addr = if i == j && names == Names::OwnNameLoopback { "127.0.1.1" } else { &self.addrs[j] };
                hosts.push_str(&format!("{addr} {name}\n"));
            }
            let dir = self.etc(i);
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            std::fs::write(dir.join("hosts"), hosts).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        Ok(())
    }

    fn etc(&self, i: usize) -> PathBuf {
        PathBuf::from("/etc/netns").join(&self.ns[i])
    }

    /// Host `i`'s address on the link.
    pub fn addr(&self, i: usize) -> &str {
        &self.addrs[i]
    }

    /// `program ARGS...` as a process of host `i`: in its namespace, under its host name. The child's pid
    /// is the program's own (ip, unshare and sh each exec the next).
    pub fn cmd(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[i], "unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\""])
            .arg(NAMES[i])
            .arg(program);
        c
    }

    /// As `cmd`, but keeping this machine's /sys and its cgroup mounts (slurmd will not start without them;
    /// `ip netns exec` mounts a fresh sysfs that has none): `nsenter` into host `i`'s network namespace, then
    /// a private mount namespace with the host's hosts file bound over /etc/hosts, as `ip netns exec` does.
    pub fn cmd_keeping_sys(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        let script = "mount --bind \"$1\" /etc/hosts && hostname \"$0\" && shift && exec \"$@\"";
        c.arg(format!("--net=/run/netns/{}", self.ns[i]))
            .args(["unshare", "--mount", "--uts", "sh", "-c", script, NAMES[i]])
            .arg(self.etc(i).join("hosts"))
            .arg(program);
        c
    }

    /// The pids of every process in host `i`'s network namespace.
    pub fn pids(&self, i: usize) -> Vec<u32> {
        let o = Command::new("ip").args(["netns", "pids", &self.ns[i]]).output();
        o.map(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Take host `i`'s end of the link down (its peer sees nothing more, and no connection breaks).
    pub fn link_down(&self, i: usize) {
        ip(&["-n", &self.ns[i], "link", "set", &self.veth[i], "down"]).unwrap();
    }

    /// 50 ms of delay and 1% loss on host `i`'s side of the link: netem where the kernel has it; else
    /// (a kernel built without sch_netem) 1% of packets dropped at random both ways by nftables and the
    /// link throttled by a token bucket, whose queue adds the delay. Returns what it did.
    pub fn impair(&self, i: usize) -> String {
        let (ns, v) = (&self.ns[i], &self.veth[i]);
        let tc = |args: &[&str]| Command::new("ip").args(["netns", "exec", ns, "tc"]).args(args).output().unwrap();
        let o = tc(&["qdisc", "add", "dev", v, "root", "netem", "delay", "50ms", "loss", "1%"]);
        if o.status.success() {
            return "netem delay 50ms loss 1%".into();
        }
        let netem = String::from_utf8_lossy(&o.stderr).trim().to_string();
        let chain = |hook: &str| {
            format!(" chain {hook} {{ type filter hook {hook} priority 0; numgen random mod 100 < 1 counter drop; }}\n")
        };
        let rules = format!("table inet harpe_loss {{\n{}{}}}\n", chain("input"), chain("output"));
        let mut nft = Command::new("ip")
            .args(["netns", "exec", ns, "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("nft (apt-get install nftables) for the loss when netem is missing");
        use std::io::Write;
        nft.stdin.take().unwrap().write_all(rules.as_bytes()).unwrap();
        assert!(nft.wait().unwrap().success(), "nft could not add the loss rules");
        let o = tc(&["qdisc", "add", "dev", v, "root", "tbf", "rate", "8mbit", "burst", "16kb", "latency", "200ms"]);
        assert!(o.status.success(), "tc tbf: {}", String::from_utf8_lossy(&o.stderr));
        format!("no netem in this kernel ({netem}): nftables 1% random drop both ways + tbf 8mbit (queueing delay)")
    }

    /// Packets `impair` has dropped on host `i` by nftables (`None`: netem does the dropping there).
    pub fn dropped(&self, i: usize) -> Option<u64> {
        let o = Command::new("ip")
            .args(["netns", "exec", &self.ns[i], "nft", "list", "table", "inet", "harpe_loss"])
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let counts = text.split("packets ").skip(1).filter_map(|t| t.split_whitespace().next()?.parse::<u64>().ok());
        Some(counts.sum())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..2 {
            // deleting a namespace kills no process; the tests end theirs first
            let _ = ip(&["netns", "del", &self.ns[i]]);
            let _ = std::fs::remove_dir_all(self.etc(i));
        }
    }
}
