//! What the load generator reads of the machine and the server processes: CPU time (user and
//! kernel, of processes, threads and the host), resident memory, and percentiles.

use crate::*;

pub(crate) fn now_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// Utime + stime of the processes, in microseconds (from /proc, in clock ticks of 10 ms).
pub(crate) fn cpu_micros(pids: &[u32]) -> u64 {
    let usage = Usage::read(pids);
    usage.user_us + usage.sys_us
}

/// What the server processes have used so far: CPU in user space and in the kernel (from
/// /proc/PID/stat, in microseconds) and write system calls (`syscw` of /proc/PID/io: write and
/// writev, which the gateway's SSE and NDJSON streams and Nchan use; not send, which WebSocket
/// frames go out by).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    pub(crate) user_us: u64,
    pub(crate) sys_us: u64,
    pub(crate) writes: u64,
    pub(crate) host: Host,
}

/// The machine's CPU time in clock ticks (the `cpu` line of /proc/stat): all of it, and the
/// time the hypervisor ran something else while this machine had work (`steal`), during which
/// a server's wall clock runs on without it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Host {
    pub(crate) ticks: u64,
    pub(crate) steal: u64,
}

impl Host {
    pub(crate) fn read() -> Host {
        Host::parse(&std::fs::read_to_string("/proc/stat").unwrap_or_default())
    }

    /// The `cpu` line's first eight fields: user, nice, system, idle, iowait, irq, softirq, steal.
    pub(crate) fn parse(stat: &str) -> Host {
        let fields: Vec<u64> = stat
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("cpu "))
            .map(|l| l.split_whitespace().take(8).filter_map(|f| f.parse().ok()).collect())
            .unwrap_or_default();
        Host { ticks: fields.iter().sum(), steal: fields.get(7).copied().unwrap_or(0) }
    }

    pub(crate) fn since(self, before: Host) -> Host {
        Host { ticks: self.ticks.saturating_sub(before.ticks), steal: self.steal.saturating_sub(before.steal) }
    }

    /// The share of the machine's time the hypervisor took (`null` when /proc/stat says nothing).
    pub(crate) fn steal_share(&self) -> Value {
        if self.ticks == 0 { Value::Null } else { json!(self.steal as f64 / self.ticks as f64) }
    }
}

impl Usage {
    pub(crate) fn read(pids: &[u32]) -> Usage {
        let mut usage = Usage { host: Host::read(), ..Usage::default() };
        for pid in pids {
            if let Some((user, sys)) = stat_cpu_micros(&format!("/proc/{pid}/stat")) {
                usage.user_us += user;
                usage.sys_us += sys;
            }
            usage.writes += std::fs::read_to_string(format!("/proc/{pid}/io"))
                .ok()
                .and_then(|io| io.lines().find_map(|l| l.strip_prefix("syscw:")?.trim().parse::<u64>().ok()))
                .unwrap_or(0);
        }
        usage
    }

    pub(crate) fn since(self, before: Usage) -> Usage {
        Usage {
            user_us: self.user_us.saturating_sub(before.user_us),
            sys_us: self.sys_us.saturating_sub(before.sys_us),
            writes: self.writes.saturating_sub(before.writes),
            host: self.host.since(before.host),
        }
    }

    pub(crate) fn cpu_us(&self) -> u64 {
        self.user_us + self.sys_us
    }

    /// Where a fan-out's server CPU went, per delivery and per write system call.
    pub(crate) fn split(&self, delivered: u64) -> Value {
        let per = |n: u64, d: u64| if d == 0 { Value::Null } else { json!(n as f64 / d as f64) };
        json!({
            "server_user_us_per_delivery": per(self.user_us, delivered),
            "server_sys_us_per_delivery": per(self.sys_us, delivered),
            "server_writes": self.writes,
            "deliveries_per_write": per(delivered, self.writes),
            "server_sys_us_per_write": per(self.sys_us, self.writes),
            "host_steal_share": self.host.steal_share(),
        })
    }
}

/// User and kernel CPU time from a /proc `stat` file (of a process, or `/proc/thread-self/stat`
/// for the calling thread), in microseconds (counted in clock ticks of 10 ms).
pub(crate) fn stat_cpu_micros(path: &str) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(path).ok()?;
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11).map(|f| f.parse::<u64>().ok());
    Some((fields.next()?? * 10_000, fields.next()?? * 10_000))
}

/// CPU time of the calling thread so far: (user, kernel) in microseconds.
pub(crate) fn thread_cpu_micros() -> (u64, u64) {
    stat_cpu_micros("/proc/thread-self/stat").unwrap_or_default()
}

/// Resident memory of the processes, in KiB.
pub(crate) fn rss_kib(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .filter_map(|s| s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

pub(crate) fn percentile<T: Copy + Into<u64>>(sorted: &[T], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].into()
}
