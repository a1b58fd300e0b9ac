//! When a turn's rounds run: the pacing decision, a pure function of the turn's pacing state,
//! the time, and the flush window (which the hub derives from how many watchers read turns in
//! flight). The rules, with their reasons, are in `docs/streaming.md` ("Pacing"); the buffer
//! (`buffer.rs`) carries the decisions out.

use std::time::Duration;

use tokio::time::Instant;

/// How long paced deltas may wait for their round: a trade of latency for CPU that an operator
/// may move either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushWindow {
    /// The window per watcher reading an in-flight turn.
    pub per_reader: Duration,
    /// The longest window.
    pub max: Duration,
}

/// The configuration's defaults (`--flush-us-per-watcher`, `--flush-max-ms`), for tests; the
/// gateway builds its window from the configuration.
#[cfg(test)]
impl Default for FlushWindow {
    fn default() -> FlushWindow {
        FlushWindow { per_reader: Duration::from_micros(16), max: Duration::from_millis(40) }
    }
}

impl FlushWindow {
    /// The window with `readers` watchers reading in-flight turns: zero below 1 ms (the
    /// timer's resolution).
    pub(super) fn for_readers(&self, readers: usize) -> Duration {
        let window = self.per_reader.saturating_mul(readers.min(u32::MAX as usize) as u32);
        if window < Duration::from_millis(1) { Duration::ZERO } else { window.min(self.max) }
    }
}

/// Most phases a turn's parked watchers are staggered into.
pub(super) const PHASES: usize = 8;

/// What an event's publication starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Round {
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
pub(super) struct Decision {
    pub round: Round,
    pub deadline: Option<Instant>,
}

impl Decision {
    const EVERYONE: Decision = Decision { round: Round::Everyone, deadline: None };
}

/// A turn's pacing state: when it last ran a round, how its deltas are spaced, how its parked
/// streams are staggered.
#[derive(Debug, Default)]
pub(super) struct Pacing {
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
    pub(super) fn decide(&mut self, now: Instant, window: Duration, paced: bool) -> Decision {
        if !paced || window.is_zero() {
            self.everyone(now);
            return Decision::EVERYONE;
        }
        self.delta_at(now);
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
    /// keep it while the window is between k - 1/4 and k + 5/4 spacings (laying them out again
    /// costs a round of everyone); the first delta of a share then still waits less than the
    /// window.
    fn share(&mut self, window: Duration) -> u32 {
        self.share = match self.spacing {
            Some(spacing) if !spacing.is_zero() => {
                let ratio = window.as_secs_f64() / spacing.as_secs_f64();
                let kept = f64::from(self.phases);
                if self.phases != 0 && ratio >= kept - 0.25 && ratio < kept + 1.25 {
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
    fn the_flush_window_grows_with_readers_up_to_its_cap_and_is_zero_below_a_millisecond() {
        let flush = FlushWindow { per_reader: Duration::from_micros(20), max: Duration::from_millis(40) };
        assert_eq!(flush.for_readers(49), Duration::ZERO);
        assert_eq!(flush.for_readers(50), Duration::from_millis(1));
        assert_eq!(flush.for_readers(1_000), Duration::from_millis(20));
        assert_eq!(flush.for_readers(1_000_000), Duration::from_millis(40));
        let off = FlushWindow { per_reader: Duration::ZERO, ..flush };
        assert_eq!(off.for_readers(1_000_000), Duration::ZERO);
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
