//! A sleep to an instant at the kernel's precision, for runtimes that pace their own output.
//!
//! tokio's timer counts whole milliseconds, and a worker parks in `epoll_wait` with a timeout
//! in whole milliseconds from wherever in a millisecond it parked, so a sleep ends up to a
//! millisecond late, by a different amount each time: deltas paced 5 ms apart come up to a
//! millisecond early or late, and where the hub sends them in pairs the first of a pair waits
//! for the second that much longer. A Linux timerfd wakes the worker when it expires.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

pub struct Timer {
    fd: AsyncFd<OwnedFd>,
}

impl Timer {
    pub fn new() -> io::Result<Timer> {
        // SAFETY: timerfd_create takes no pointers; a non-negative result is a new descriptor
        // that nothing else owns.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: see above.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the AsyncFd owns the descriptor, which stays open and the same until it drops.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
        Ok(Timer { fd })
    }

    /// Returns at `at` (at once if it has passed). Setting the timer again drops an expiry a
    /// cancelled sleep left unread.
    pub async fn sleep_until(&self, at: Instant) -> io::Result<()> {
        let left = at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        let value = libc::timespec { tv_sec: left.as_secs() as libc::time_t, tv_nsec: left.subsec_nanos().into() };
        let spec = libc::itimerspec { it_interval: zero, it_value: value };
        // SAFETY: `spec` outlives the call; a null old value is allowed.
        if unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        loop {
            let mut ready = self.fd.readable().await?;
            let mut expiries = 0u64;
            // SAFETY: reads 8 bytes into a u64 it owns.
            let read = unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut expiries).cast(), 8) };
            if read == 8 {
                return Ok(());
            }
            let error = io::Error::last_os_error();
            if error.kind() != io::ErrorKind::WouldBlock {
                return Err(error);
            }
            ready.clear_ready();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::FutureExt;

    use super::*;

    #[tokio::test]
    async fn a_sleep_ends_at_its_instant_not_before_and_a_cancelled_one_leaves_nothing_behind() {
        let timer = Timer::new().unwrap();
        let at = Instant::now() + Duration::from_millis(3);
        timer.sleep_until(at).await.unwrap();
        assert!(Instant::now() >= at);
        // A sleep armed, dropped before it ends, and left to expire unread: that expiry does
        // not end the next sleep early.
        assert!(timer.sleep_until(Instant::now() + Duration::from_millis(2)).now_or_never().is_none());
        tokio::time::sleep(Duration::from_millis(10)).await;
        let at = Instant::now() + Duration::from_millis(20);
        timer.sleep_until(at).await.unwrap();
        assert!(Instant::now() >= at);
        // An instant already past returns at once.
        timer.sleep_until(Instant::now() - Duration::from_millis(1)).await.unwrap();
    }
}
