//! When a turn's rounds run: the pacing decision, a pure function of the turn's pacing state,
//! the time, and the flush window (which the hub derives from the measured cost of a round of
//! every watcher). The rules, with their reasons, are in `docs/streaming.md` ("Pacing"); the
//! buffer (`buffer.rs`) carries the decisions out.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use tokio::time::Instant;

/// How long paced deltas may wait for their round: a number of *sweeps*, the time the
/// runtime's workers take to write one event to every watcher reading a turn in flight, at the
/// cost of a write the rounds measure. When writes get dearer (a busy machine) the window grows
/// with them, and the rounds' writes keep to the same share of the workers' time.
#[derive(Debug)]
pub struct FlushWindow {
    /// Sweeps per window (0: no window).
    sweeps: u32,
    /// The longest window.
    max: Duration,
    /// The workers a sweep is shared among.
    workers: u32,
    /// What a round's write to one socket costs, in nanoseconds of the writing worker's wall
    /// time (a moving average, weighted by how many sockets a measurement covers).
    write_ns: AtomicU64,
    /// Watchers reading in-flight turns on the other gateways of a cluster (`bus/readers.rs`):
    /// the window is the cluster's, so that spreading watchers over gateways changes neither
    /// how long a delta waits nor how many a write carries.
    elsewhere: AtomicUsize,
}

/// The shortest window (the timer's resolution): a shorter one is none.
const MIN_WINDOW: Duration = Duration::from_millis(1);

/// What a write is taken to cost until the rounds have measured one (a loopback write on a
/// quiet machine, BENCHMARKS.md's write floor).
const FIRST_WRITE_NS: u64 = 4_000;

/// Bounds on a measurement per write: nothing writes a socket in less, and a round stalled for
/// longer is not a cost a window should follow.
const WRITE_NS: std::ops::RangeInclusive<u64> = 250..=1_000_000;

/// The window of the gateway's defaults (`--flush-sweeps`, `--flush-max-ms`).
impl Default for FlushWindow {
    fn default() -> FlushWindow {
        FlushWindow::new(FlushWindow::SWEEPS, Duration::from_millis(FlushWindow::MAX_MS))
    }
}

impl FlushWindow {
    /// Sweeps a window spans by default (`--flush-sweeps`).
    pub const SWEEPS: u32 = 4;
    /// The longest window by default, in milliseconds (`--flush-max-ms`).
    pub const MAX_MS: u64 = 15;

    /// A window of `sweeps` sweeps, at most `max`, shared among the current runtime's workers
    /// (one outside a runtime).
    pub fn new(sweeps: u32, max: Duration) -> FlushWindow {
        let workers = tokio::runtime::Handle::try_current().map_or(1, |r| r.metrics().num_workers()).max(1);
        FlushWindow {
            sweeps,
            max,
            workers: workers as u32,
            write_ns: AtomicU64::new(FIRST_WRITE_NS),
            elsewhere: AtomicUsize::new(0),
        }
    }

    /// The window with `readers` watchers reading in-flight turns: zero below 1 ms (the
    /// timer's resolution), at most the cap, but never under two sweeps: a shorter window would
    /// have the rounds write for more than half of the workers' time, and past all of it they
    /// fall behind, every delta later than the last. When writes are that dear (a slow stretch,
    /// a machine too small for its watchers), a longer window is the lesser latency.
    pub fn for_readers(&self, readers: usize) -> Duration {
        if self.sweeps == 0 {
            return Duration::ZERO;
        }
        let sweep = self.sweep(readers);
        let window = sweep.saturating_mul(self.sweeps).min(self.max).max(sweep.saturating_mul(2));
        if window < MIN_WINDOW { Duration::ZERO } else { window }
    }

    /// A sweep: the time the workers take to write one event to `readers` watchers and those
    /// of the cluster's other gateways, at this gateway's cost per write.
    pub(super) fn sweep(&self, readers: usize) -> Duration {
        let readers = readers.saturating_add(self.elsewhere.load(Relaxed));
        let nanos = u128::from(self.write_ns.load(Relaxed)) * readers as u128 / u128::from(self.workers);
        Duration::from_nanos(nanos.min(u64::MAX.into()) as u64)
    }

    /// A round's part wrote to `sockets` sockets in `elapsed` (wall time, so that a worker the
    /// machine keeps waiting makes writes dearer, as they are).
    pub(super) fn measured(&self, elapsed: Duration, sockets: usize) {
        if sockets == 0 {
            return;
        }
        let sample = (elapsed.as_nanos() / sockets as u128).min(u64::MAX.into()) as u64;
        let sample = sample.clamp(*WRITE_NS.start(), *WRITE_NS.end());
        // A round of many sockets moves the average more than one of a few: 1/16 of the way at
        // 256 sockets or more, up or down alike. The window's floor keeps the rounds to half the
        // workers' time on average, so it follows the mean cost; an average rising faster than
        // it fell rode the peaks (rounds preempted by the readers' wake-ups on the same cores)
        // at twice the mean and more, and held W3's deltas three spacings (docs/streaming.md).
        let weight = sockets.min(256) as i128;
        let old = self.write_ns.load(Relaxed);
        let moved = old as i128 + (sample as i128 - old as i128) * weight / 4_096;
        // Racing rounds may lose each other's update; either one is a fair measurement.
        self.write_ns.store(moved.clamp(*WRITE_NS.start() as i128, *WRITE_NS.end() as i128) as u64, Relaxed);
    }

    /// The cluster's other gateways have `readers` watchers reading in-flight turns.
    pub(super) fn set_elsewhere(&self, readers: usize) {
        self.elsewhere.store(readers, Relaxed);
    }

    pub(super) fn elsewhere(&self) -> usize {
        self.elsewhere.load(Relaxed)
    }

    /// What a write costs, as measured so far.
    pub fn write_cost(&self) -> Duration {
        Duration::from_nanos(self.write_ns.load(Relaxed))
    }
}

/// Most phases a turn's parked watchers are staggered into.
pub const PHASES: usize = 8;

/// What an event's publication starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// A round of every watcher: woken tasks and every parked stream.
    Everyone,
    /// A round of the parked streams whose phase (their attach order modulo `k`) is due; woken
    /// tasks are phase 0.
    Phases { k: u32, due: [bool; PHASES] },
    /// No round: the event waits for a later one.
    Held,
}

/// A decision: the round to run now, and when a round of everyone is due at the latest unless
/// one runs before (a timer the buffer arms; `None`: no new deadline).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub round: Round,
    pub deadline: Option<Instant>,
}

impl Decision {
    const EVERYONE: Decision = Decision { round: Round::Everyone, deadline: None };
}

/// A turn's pacing state: when it last ran a round, how its deltas are spaced, how its parked
/// streams are staggered.
#[derive(Debug, Default)]
pub struct Pacing {
    /// The last round, of every watcher or of one phase.
    last_round: Option<Instant>,
    /// Deltas since the last round of everyone.
    deltas: u32,
    last_delta: Option<Instant>,
    /// The usual interval between the turn's deltas (a moving average).
    spacing: Option<Duration>,
    /// Deltas per write at the last delta (see [`Pacing::share`]).
    share: u32,
    /// The share the phases are laid out for (0: not staggered).
    phases: u32,
    /// Per phase, the delta (counted as in `deltas`) with which it writes next.
    next_write: [u32; PHASES],
    /// Per phase, when the oldest delta it has not been written was published.
    unsent_since: [Option<Instant>; PHASES],
    /// When the first delta since the last round of everyone was published.
    first_delta: Option<Instant>,
    /// When a round of everyone is due unless deltas start rounds first.
    pub(super) deadline: Option<Instant>,
    /// Where the buffer's timer sleeps to, if one does.
    pub(super) timer: Option<Instant>,
}

impl Pacing {
    /// The decision for an event published at `now`: a delta (`paced`) under `window`, or
    /// anything else (which always starts a round of everyone). The state moves as if the
    /// decision were carried out.
    pub fn decide(&mut self, now: Instant, window: Duration, paced: bool) -> Decision {
        if paced {
            self.delta_at(now);
        }
        if !paced || window.is_zero() {
            self.everyone(now);
            return Decision::EVERYONE;
        }
        if self.last_round.is_none_or(|last| now >= last + window) {
            self.everyone(now);
            return Decision::EVERYONE;
        }
        let share = self.share(window);
        self.deltas += 1;
        if self.deltas == 1 {
            self.first_delta = Some(now);
        }
        if self.phases != 0 || (2..=PHASES as u32).contains(&share) {
            if share != self.phases {
                if self.phases != 0 {
                    // Phases laid out for another share: everyone now, and they start over.
                    self.everyone(now);
                    return Decision::EVERYONE;
                }
                // Every round since the last of everyone was one of everyone: lay the phases
                // out as if from that one.
                self.lay_out_phases();
            }
            return self.phase_round(now, window);
        }
        if self.deltas >= share {
            self.everyone(now);
            return Decision::EVERYONE;
        }
        // The first delta held arms the deadline: the window's end and half a spacing more, so
        // that a share gathered on time starts the round itself rather than racing the timer.
        let deadline = (self.deltas == 1).then(|| self.last_round.map(|last| last + window + self.slack())).flatten();
        if deadline.is_some() {
            self.deadline = deadline;
        }
        Decision { round: Round::Held, deadline }
    }

    /// Whether the turn's deltas come far enough apart, on average, that a round per delta
    /// writes no more than woken watchers would (they batch only what arrives while they wake)
    /// and keeps to half the workers' time: a spacing of a window's least (1 ms) and two
    /// `sweep`s. Then the rounds write to parked streams even with the window closed (few
    /// watchers), which spares each delivery its task's wake-up.
    pub(super) fn spaced(&self, sweep: Duration) -> bool {
        self.spacing.is_some_and(|spacing| spacing >= MIN_WINDOW.max(sweep.saturating_mul(2)))
    }

    /// A round of everyone runs at `now` (a decision's, or the deadline's): the phases start
    /// over from it.
    pub(super) fn everyone(&mut self, now: Instant) {
        self.last_round = Some(now);
        self.deltas = 0;
        self.first_delta = None;
        self.deadline = None;
        self.lay_out_phases();
    }

    fn delta_at(&mut self, now: Instant) {
        if let Some(last) = self.last_delta {
            let gap = now - last;
            self.spacing = Some(self.spacing.map_or(gap, |s| (s * 7 + gap) / 8));
        }
        self.last_delta = Some(now);
    }

    /// Half a spacing: how long past a window's end a round of everyone waits for the share.
    fn slack(&self) -> Duration {
        self.spacing.unwrap_or_default() / 2
    }

    /// How many deltas a window usually gathers (at least two; unbounded while the deltas come
    /// all at once): the deltas one write per watcher carries. Phases laid out for a share of k
    /// keep it while the window is between k - 3/4 and k + 7/4 spacings, and the most phases
    /// up to twice their number: laying them out again costs a round of everyone, and on a
    /// busy machine the window and the spacing jitter. The first delta of a share then still
    /// waits less than the window (k - 1 spacings); a wider window only batches less than it
    /// could.
    fn share(&mut self, window: Duration) -> u32 {
        self.share = match self.spacing {
            Some(spacing) if !spacing.is_zero() => {
                let ratio = window.as_secs_f64() / spacing.as_secs_f64();
                let kept = f64::from(self.phases);
                let above = if self.phases == PHASES as u32 { kept } else { 1.75 };
                if self.phases != 0 && ratio >= kept - 0.75 && ratio < kept + above {
                    self.phases
                } else {
                    (window.as_nanos() / spacing.as_nanos()).clamp(2, u32::MAX.into()) as u32
                }
            }
            _ => u32::MAX,
        };
        self.share
    }

    /// Lays the phases out for the current share (none past [`PHASES`]), the first to write
    /// with the next delta (with this one, when deltas already wait), then one per delta in turn.
    fn lay_out_phases(&mut self) {
        self.phases = if (2..=PHASES as u32).contains(&self.share) { self.share } else { 0 };
        let k = self.phases as usize;
        let from = self.deltas.saturating_sub(1);
        for p in 0..k {
            self.next_write[p] = from + ((p + k - 1) % k) as u32 + 1;
            self.unsent_since[p] = self.first_delta;
        }
    }

    /// The round of the phases that write with the current delta.
    fn phase_round(&mut self, now: Instant, window: Duration) -> Decision {
        let (k, c) = (self.phases as usize, self.deltas);
        let mut due = [false; PHASES];
        let mut oldest: Option<Instant> = None;
        for ((next, unsent), due) in self.next_write.iter_mut().zip(&mut self.unsent_since).zip(&mut due).take(k) {
            if c >= *next {
                *next = c + k as u32;
                *unsent = None;
                *due = true;
            } else {
                let since = *unsent.get_or_insert(now);
                oldest = Some(oldest.map_or(since, |o| o.min(since)));
            }
        }
        self.last_round = Some(now);
        self.deadline = oldest.map(|since| since + window + self.slack());
        Decision { round: Round::Phases { k: k as u32, due }, deadline: self.deadline }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Deltas `gap` apart under `window`, after a round of everyone at `t0`: the decisions.
    fn deltas(pacing: &mut Pacing, t0: Instant, gap: Duration, window: Duration, n: u32) -> Vec<Decision> {
        (1..=n).map(|i| pacing.decide(t0 + gap * i, window, true)).collect()
    }

    #[test]
    fn the_flush_window_is_sweeps_of_the_measured_write_cost_up_to_its_cap_and_zero_below_a_millisecond() {
        let flush = FlushWindow { workers: 2, ..FlushWindow::new(4, Duration::from_millis(40)) };
        // Before any round: 4 us a write, 4 sweeps, two workers: 8 us a watcher.
        assert_eq!(flush.for_readers(124), Duration::ZERO);
        assert_eq!(flush.for_readers(125), Duration::from_millis(1));
        assert_eq!(flush.for_readers(1_000), Duration::from_millis(8));
        assert_eq!(flush.for_readers(5_000), Duration::from_millis(40));
        assert_eq!(flush.for_readers(10_000), Duration::from_millis(40));
        let off = FlushWindow { sweeps: 0, ..FlushWindow::new(0, Duration::from_millis(40)) };
        assert_eq!(off.for_readers(1_000_000), Duration::ZERO);
    }

    #[test]
    fn at_the_defaults_dearer_writes_stop_widening_the_window_at_the_cap_until_two_sweeps_pass_it() {
        // 1,000 watchers on two workers, 4 sweeps, a 15 ms cap: while 4 sweeps fit, the window
        // follows the cost of a write; past the cap it stays there (a dearer write costs CPU, not
        // latency) until two sweeps are longer.
        let flush = FlushWindow { workers: 2, ..FlushWindow::default() };
        let at = |write_us: u64| {
            flush.write_ns.store(write_us * 1_000, Relaxed);
            flush.for_readers(1_000)
        };
        assert_eq!(at(4), Duration::from_millis(8));
        assert_eq!(at(10), Duration::from_millis(15));
        assert_eq!(at(14), Duration::from_millis(15));
        assert_eq!(at(20), Duration::from_millis(20));
    }

    #[test]
    fn past_the_cap_the_window_is_two_sweeps_so_that_the_rounds_keep_up() {
        // 20,000 watchers at 4 us a write on two workers: a sweep is 40 ms. Under the 40 ms cap
        // the rounds would write for all of the workers' time; two sweeps leave them half.
        let flush = FlushWindow { workers: 2, ..FlushWindow::new(4, Duration::from_millis(40)) };
        assert_eq!(flush.for_readers(20_000), Duration::from_millis(80));
        assert_eq!(flush.for_readers(1_000_000), Duration::from_secs(4));
        // Fewer sweeps than two: the same floor.
        let one = FlushWindow { workers: 2, ..FlushWindow::new(1, Duration::from_secs(1)) };
        assert_eq!(one.for_readers(1_000), Duration::from_millis(4));
    }

    #[test]
    fn the_window_follows_the_mean_cost_of_a_write_moving_up_and_down_alike() {
        let flush = FlushWindow { workers: 2, ..FlushWindow::new(4, Duration::from_millis(400)) };
        // A round of 500 sockets at 10 us a write moves the average 1/16 of the way.
        let before = flush.for_readers(1_000);
        flush.measured(Duration::from_millis(5), 500);
        assert_eq!(flush.write_cost(), Duration::from_nanos(4_375));
        for _ in 0..60 {
            flush.measured(Duration::from_millis(5), 500);
        }
        assert_eq!(before, Duration::from_millis(8));
        assert!(flush.write_cost() > Duration::from_nanos(9_800), "{:?}", flush.write_cost());
        assert!(flush.for_readers(1_000) > Duration::from_millis(19), "{:?}", flush.for_readers(1_000));
        // A round of one socket hardly moves it, even a stalled one.
        let was = flush.write_cost();
        flush.measured(Duration::from_millis(1), 1);
        assert!(flush.write_cost() > was && flush.write_cost() < Duration::from_nanos(10_200));
        // Rounds at 2 us and at 20 us a write in turn: the average settles at their mean, not
        // at the dear ones (which, on a busy machine, are the rounds the readers preempted).
        for _ in 0..200 {
            flush.measured(Duration::from_millis(1), 500);
            flush.measured(Duration::from_millis(10), 500);
        }
        let cost = flush.write_cost();
        assert!(cost > Duration::from_micros(10) && cost < Duration::from_micros(12), "{cost:?}");
        // Cheap rounds bring it down within a couple of hundred rounds.
        for _ in 0..200 {
            flush.measured(Duration::from_micros(1_000), 500);
        }
        assert!(flush.write_cost() < Duration::from_nanos(2_100), "{:?}", flush.write_cost());
        // Nothing written: no measurement; a stalled round counts as 1 ms a write at most.
        flush.measured(Duration::from_secs(1), 0);
        assert!(flush.write_cost() < Duration::from_nanos(2_100));
        for _ in 0..100 {
            flush.measured(Duration::from_secs(100), 300);
        }
        assert!(flush.write_cost() <= Duration::from_millis(1));
        // Past the 400 ms cap: two sweeps of 1,000 watchers at (nearly) 1 ms a write on two
        // workers.
        let window = flush.for_readers(1_000);
        assert!(window > Duration::from_millis(990) && window <= Duration::from_secs(1), "{window:?}");
    }

    #[test]
    fn deltas_are_spaced_when_they_come_a_millisecond_and_two_sweeps_apart_window_or_not() {
        let mut pacing = Pacing::default();
        let t0 = Instant::now();
        let sweep = Duration::from_micros(200);
        // No spacing known before the second delta.
        pacing.decide(t0, Duration::ZERO, true);
        assert!(!pacing.spaced(sweep));
        // Deltas 5 ms apart under a closed window: each goes at once, and they are spaced.
        let got = deltas(&mut pacing, t0, 5 * MS, Duration::ZERO, 10);
        assert!(got.iter().all(|d| *d == Decision::EVERYONE), "{got:?}");
        assert!(pacing.spaced(sweep));
        // Not when a round would take more than half the spacing.
        assert!(!pacing.spaced(3 * MS));
        // A burst brings the spacing under a millisecond within a few deltas.
        let t = t0 + 50 * MS;
        let burst: Vec<bool> = (0..20)
            .map(|i| {
                pacing.decide(t + Duration::from_micros(10 * i), Duration::ZERO, true);
                pacing.spaced(sweep)
            })
            .collect();
        assert!(burst[..5].iter().all(|s| *s) && !burst[19], "{burst:?}");
        // Events that are not deltas do not move it.
        for i in 0..20 {
            pacing.decide(t + 10 * MS + MS * i, Duration::ZERO, false);
        }
        assert!(!pacing.spaced(sweep));
    }

    #[test]
    fn with_no_window_or_for_anything_but_a_delta_everyone_goes_at_once() {
        let mut pacing = Pacing::default();
        let t0 = Instant::now();
        assert_eq!(pacing.decide(t0, Duration::ZERO, true).round, Round::Everyone);
        assert_eq!(pacing.decide(t0 + MS, 40 * MS, false).round, Round::Everyone);
        // The first delta after a round a whole window ago goes at once too.
        assert_eq!(pacing.decide(t0 + 50 * MS, 40 * MS, true).round, Round::Everyone);
    }

    #[test]
    fn a_delta_within_the_window_is_held_until_a_deadline_a_window_and_half_a_spacing_after_the_round() {
        let mut pacing = Pacing::default();
        let t0 = Instant::now();
        pacing.decide(t0, 40 * MS, false);
        // Deltas 1 ms apart: a share of 40, more than the phases. The first one held arms the
        // window's end (no spacing known yet, so no slack); the others wait with it.
        let got = deltas(&mut pacing, t0, MS, 40 * MS, 39);
        assert_eq!(got[0], Decision { round: Round::Held, deadline: Some(t0 + 40 * MS) });
        assert!(got[1..].iter().all(|d| *d == Decision { round: Round::Held, deadline: None }), "{got:?}");
        // The window's end: the next delta starts a round of everyone.
        assert_eq!(pacing.decide(t0 + 40 * MS, 40 * MS, true).round, Round::Everyone);
        // And the one after is held until a window and half a spacing after that round.
        let next = pacing.decide(t0 + 41 * MS, 40 * MS, true);
        assert_eq!(next, Decision { round: Round::Held, deadline: Some(t0 + 80 * MS + MS / 2) });
    }

    #[test]
    fn evenly_spaced_deltas_stagger_the_phases_one_per_delta_each_every_share() {
        // 10 ms apart under a 30 ms window: a share of 3.
        let mut pacing = Pacing::default();
        let t0 = Instant::now();
        pacing.decide(t0, 30 * MS, false);
        let got = deltas(&mut pacing, t0, 10 * MS, 30 * MS, 30);
        let steady: Vec<[bool; PHASES]> = got[6..]
            .iter()
            .map(|d| match d.round {
                Round::Phases { k: 3, due } => due,
                other => panic!("{other:?} in {got:?}"),
            })
            .collect();
        for (i, due) in steady.iter().enumerate() {
            // One phase per delta, in turn.
            assert_eq!(due.iter().filter(|d| **d).count(), 1, "{steady:?}");
            assert_eq!(*due, steady[i % 3], "{steady:?}");
        }
        // Every phase has a deadline for what it has not been sent, a window and half a spacing
        // after its oldest delta.
        let last = got.last().unwrap();
        assert_eq!(last.deadline, Some(t0 + 290 * MS + 30 * MS + 5 * MS));
    }

    #[test]
    fn phases_stay_laid_out_while_the_window_and_the_spacing_jitter() {
        // A busy machine: deltas 4 or 6 ms apart (5 on average), a window between 33 and 40 ms
        // as the measured write cost moves (a share of 6.6 to 8 spacings).
        let mut pacing = Pacing::default();
        let t0 = Instant::now();
        pacing.decide(t0, 40 * MS, false);
        let mut t = t0;
        let mut rounds = Vec::new();
        for i in 0..400u32 {
            t += if i % 2 == 0 { 4 * MS } else { 6 * MS };
            let window = [40, 36, 33, 38][(i / 7 % 4) as usize] * MS;
            rounds.push(pacing.decide(t, window, true).round);
        }
        // Past the first few layouts, every round is one phase's: no round of everyone lays
        // them out again.
        let everyone = rounds[40..].iter().filter(|r| **r == Round::Everyone).count();
        assert_eq!(everyone, 0, "{rounds:?}");
        assert!(rounds[40..].iter().all(|r| matches!(r, Round::Phases { k: 6 | 7, .. })), "{rounds:?}");
        // At the most phases, a window that jitters above them (8 to 10.4 spacings) keeps them too.
        let mut rounds = Vec::new();
        for i in 0..400u32 {
            t += if i % 2 == 0 { 4 * MS } else { 6 * MS };
            let window = [40, 46, 52, 44][(i / 7 % 4) as usize] * MS;
            rounds.push(pacing.decide(t, window, true).round);
        }
        assert!(rounds[40..].iter().all(|r| matches!(r, Round::Phases { k: 8, .. })), "{rounds:?}");
    }

    #[test]
    fn a_share_that_moves_lays_the_phases_out_again_after_a_round_of_everyone() {
        let mut pacing = Pacing::default();
        let t0 = Instant::now();
        pacing.decide(t0, 30 * MS, false);
        let got = deltas(&mut pacing, t0, 10 * MS, 30 * MS, 12);
        assert!(matches!(got[11].round, Round::Phases { k: 3, .. }));
        // The window doubles (twice the watchers): the share becomes 6, and the phases laid out
        // for 3 give way to a round of everyone.
        let t = t0 + 120 * MS;
        let mut moved = Vec::new();
        for i in 1..=20 {
            moved.push(pacing.decide(t + 10 * MS * i, 60 * MS, true).round);
        }
        let first_everyone = moved.iter().position(|r| *r == Round::Everyone).expect("a round of everyone");
        assert!(moved[first_everyone + 1..].iter().all(|r| matches!(r, Round::Phases { k: 6, .. })), "{moved:?}");
    }
}
