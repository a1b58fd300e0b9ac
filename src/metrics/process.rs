//! The process's own figures under the names every Prometheus client library gives them
//! (`process_*`), so the usual dashboards and alerts (memory, CPU, file descriptors left, restarts)
//! work on the gateway as they are. Read from the kernel at each scrape; a figure it cannot read
//! is left out rather than reported as zero.

use std::fmt::Write;
use std::sync::OnceLock;

pub(super) fn render(out: &mut String) {
    let mut figure = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    };
    if let Some(seconds) = cpu_seconds() {
        figure("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.", seconds);
    }
    if let Some((virtual_bytes, resident_bytes)) = memory() {
        figure("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", virtual_bytes as f64);
        figure("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", resident_bytes as f64);
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        figure("process_open_fds", "gauge", "Number of open file descriptors.", fds.count() as f64);
    }
    if let Some(limit) = crate::open_files::limit() {
        figure("process_max_fds", "gauge", "Maximum number of open file descriptors.", limit.rlim_cur as f64);
    }
    if let Some(started) = start_time() {
        figure(
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            started,
        );
    }
}

/// User and system time of every thread, from `getrusage` (no clock-tick conversion).
fn cpu_seconds() -> Option<f64> {
    // SAFETY: getrusage fills the struct it is given; zeroed is a valid rusage.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return None;
    }
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Some(seconds(usage.ru_utime) + seconds(usage.ru_stime))
}

/// Virtual and resident size in bytes: `/proc/self/statm` counts pages.
fn memory() -> Option<(u64, u64)> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let mut pages = statm.split_whitespace().map(|n| n.parse::<u64>().ok());
    let (size, resident) = (pages.next()??, pages.next()??);
    // SAFETY: sysconf reads a constant of the system.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    Some((size * page, resident * page))
}

/// When the process started, in unix seconds: the boot time plus the clock ticks after it the
/// process began (`/proc/self/stat`, field 22). It does not change, so it is read once.
fn start_time() -> Option<f64> {
    static STARTED: OnceLock<Option<f64>> = OnceLock::new();
    *STARTED.get_or_init(|| {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The command name (field 2) is in parentheses and may hold spaces: count from after it.
        let after_name = &stat[stat.rfind(')')? + 1..];
        let ticks: u64 = after_name.split_whitespace().nth(19)?.parse().ok()?;
        let boot: u64 = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        // SAFETY: sysconf reads a constant of the system.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        (per_second > 0).then(|| boot as f64 + ticks as f64 / per_second as f64)
    })
}
