//! Derived numbers of a turn: step timing, step and turn usage, context size.
//! Pure: the caller passes the instants, taken from a monotonic clock.

use std::time::{Duration, Instant};

use crate::wire::{StepMetrics, TurnMetrics, Usage};

/// A step being generated.
#[derive(Debug)]
pub struct OpenStep {
    pub step_id: String,
    started: Instant,
    first_token: Option<Instant>,
    usage: Option<Usage>,
    /// The tokens of the request that began the step, as the gateway estimates them.
    pub sent_tokens: u64,
    /// Bytes the step streamed (text, reasoning, tool calls).
    streamed_bytes: u64,
}

/// Step timing as `step-complete` carries it: `genTotalMs == ttftMs + decodeMs` exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTiming {
    pub ttft_ms: Option<u64>,
    pub decode_ms: Option<u64>,
    pub gen_total_ms: u64,
}

fn ms(d: Duration) -> u64 {
    // Rounded to the nearest millisecond.
    ((d.as_micros() + 500) / 1000) as u64
}

impl OpenStep {
    pub fn new(step_id: String, started: Instant) -> OpenStep {
        OpenStep { step_id, started, first_token: None, usage: None, sent_tokens: 0, streamed_bytes: 0 }
    }

    /// `bytes` of the model's output arrived (a delta, a tool call).
    pub fn streamed(&mut self, bytes: usize) {
        self.streamed_bytes = self.streamed_bytes.saturating_add(bytes as u64);
    }

    /// What the step costs when no usage is reported for it: the request's estimate and the
    /// output at the estimator's four bytes a token.
    fn estimate(&self) -> u64 {
        self.sent_tokens.saturating_add(self.streamed_bytes.div_ceil(4))
    }

    /// A text or reasoning delta arrived.
    pub fn token(&mut self, at: Instant) {
        self.first_token.get_or_insert(at);
    }

    fn timing(&self, ended: Instant) -> StepTiming {
        let gen_total_ms = ms(ended.saturating_duration_since(self.started));
        match self.first_token {
            Some(first) => {
                let ttft = ms(first.saturating_duration_since(self.started)).min(gen_total_ms);
                StepTiming { ttft_ms: Some(ttft), decode_ms: Some(gen_total_ms - ttft), gen_total_ms }
            }
            None => StepTiming { ttft_ms: None, decode_ms: None, gen_total_ms },
        }
    }
}

/// Everything a turn's metrics are built from.
#[derive(Debug)]
pub struct TurnTally {
    started: Instant,
    steps: Vec<StepMetrics>,
    /// Per closed step: whether the runtime reported usage for it.
    reported: Vec<bool>,
    /// Per closed step: its estimated tokens, charged when no usage is reported for it.
    estimates: Vec<u64>,
}

/// What a turn costs its subject's day of tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    pub tokens: u64,
    /// Steps charged their estimate (no usage reported for them: stopped, failed, cut, or an
    /// upstream that does not report).
    pub estimated_steps: usize,
}

impl TurnTally {
    pub fn new(started: Instant) -> TurnTally {
        TurnTally { started, steps: Vec::new(), reported: Vec::new(), estimates: Vec::new() }
    }

    pub fn step_count(&self) -> usize {
        self.steps.len()
    }

    /// Adds a usage report to the open step, or to the last closed one when none is open
    /// (some runtimes report usage after the step's end). Returns false when there is no step.
    pub fn add_usage(&mut self, open: Option<&mut OpenStep>, usage: &Usage) -> bool {
        match open {
            Some(step) => {
                step.usage.get_or_insert_with(Usage::default).add(usage);
                true
            }
            None => match (self.steps.last_mut(), self.reported.last_mut()) {
                (Some(last), Some(reported)) => {
                    last.usage.add(usage);
                    last.usage_reported = true;
                    *reported = true;
                    true
                }
                _ => false,
            },
        }
    }

    /// Closes a step at `ended`: records its metrics and returns its timing.
    pub fn close_step(&mut self, step: OpenStep, ended: Instant) -> StepTiming {
        let timing = step.timing(ended);
        self.reported.push(step.usage.is_some());
        self.estimates.push(step.estimate());
        self.steps.push(StepMetrics {
            step_id: step.step_id,
            usage: step.usage.unwrap_or_default(),
            ttft_ms: timing.ttft_ms,
            decode_ms: timing.decode_ms,
            gen_total_ms: Some(timing.gen_total_ms),
            usage_reported: step.usage.is_some(),
        });
        timing
    }

    /// `done.usage`: the sum over steps, absent when no step reported usage.
    pub fn usage(&self) -> Option<Usage> {
        if !self.reported.iter().any(|r| *r) {
            return None;
        }
        let mut total = Usage::default();
        for s in &self.steps {
            total.add(&s.usage);
        }
        Some(total)
    }

    /// The turn's charge: the usage reported, step by step, and the estimate of each step
    /// without a report.
    pub fn charge(&self) -> Charge {
        let mut charge = Charge { tokens: 0, estimated_steps: 0 };
        for ((step, reported), estimate) in self.steps.iter().zip(&self.reported).zip(&self.estimates) {
            let tokens = if *reported {
                step.usage.input_tokens.saturating_add(step.usage.output_tokens)
            } else {
                charge.estimated_steps += 1;
                *estimate
            };
            charge.tokens = charge.tokens.saturating_add(tokens);
        }
        charge
    }

    /// `done.contextSize`: input + output of the last step that reported usage.
    pub fn context_size(&self) -> Option<u64> {
        self.steps
            .iter()
            .zip(&self.reported)
            .rev()
            .find(|(_, reported)| **reported)
            .map(|(s, _)| s.usage.input_tokens + s.usage.output_tokens)
    }

    pub fn duration_ms(&self, ended: Instant) -> u64 {
        ms(ended.saturating_duration_since(self.started))
    }

    /// The persisted counterpart of `done`, built from the same numbers.
    pub fn metrics(&self, turn_id: &str, duration_ms: u64) -> TurnMetrics {
        TurnMetrics {
            turn_id: turn_id.to_owned(),
            usage: self.usage().unwrap_or_default(),
            duration_ms: Some(duration_ms),
            steps: self.steps.clone(),
            context_size: self.context_size(),
            usage_reported: self.reported.iter().any(|r| *r),
            // Kept in the turn's own row, added when the metrics are read.
            reason: None,
            first_seq: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(i: u64, o: u64) -> Usage {
        Usage { input_tokens: i, output_tokens: o, ..Usage::default() }
    }

    #[test]
    fn timing_adds_up_and_context_is_the_last_step() {
        let t0 = Instant::now();
        let mut tally = TurnTally::new(t0);
        let mut s0 = OpenStep::new("t#0".into(), t0);
        s0.token(t0 + Duration::from_micros(12_400));
        tally.add_usage(Some(&mut s0), &usage(100, 10));
        let timing = tally.close_step(s0, t0 + Duration::from_micros(50_600));
        assert_eq!(timing, StepTiming { ttft_ms: Some(12), decode_ms: Some(39), gen_total_ms: 51 });

        let mut s1 = OpenStep::new("t#1".into(), t0 + Duration::from_millis(60));
        tally.add_usage(Some(&mut s1), &usage(130, 5));
        tally.add_usage(Some(&mut s1), &Usage { cache_read_tokens: Some(7), ..usage(0, 1) });
        let timing = tally.close_step(s1, t0 + Duration::from_millis(70));
        assert_eq!(timing, StepTiming { ttft_ms: None, decode_ms: None, gen_total_ms: 10 });

        assert_eq!(tally.usage(), Some(Usage { cache_read_tokens: Some(7), ..usage(230, 16) }));
        assert_eq!(tally.context_size(), Some(136));
        let m = tally.metrics("t", 80);
        assert_eq!(m.usage, tally.usage().unwrap());
        assert_eq!(m.steps.len(), 2);
        assert_eq!(m.context_size, Some(136));
    }

    #[test]
    fn no_usage_means_absent_totals_and_zero_metrics() {
        let t0 = Instant::now();
        let mut tally = TurnTally::new(t0);
        tally.close_step(OpenStep::new("t#0".into(), t0), t0);
        assert_eq!(tally.usage(), None);
        assert_eq!(tally.context_size(), None);
        assert_eq!(tally.metrics("t", 0).usage, Usage::default());
        // Usage that arrives after the step closed still counts for that step.
        assert!(tally.add_usage(None, &usage(3, 4)));
        assert_eq!(tally.context_size(), Some(7));
    }

    #[test]
    fn a_step_without_usage_is_charged_its_estimate() {
        let t0 = Instant::now();
        let mut tally = TurnTally::new(t0);
        let mut s0 = OpenStep::new("t#0".into(), t0);
        s0.sent_tokens = 1_000;
        s0.streamed(4_000);
        tally.add_usage(Some(&mut s0), &usage(900, 20));
        tally.close_step(s0, t0);
        let mut s1 = OpenStep::new("t#1".into(), t0);
        s1.sent_tokens = 1_200;
        s1.streamed(401);
        tally.close_step(s1, t0);
        // Reported: what was reported (not the estimate); the second: 1,200 + 401 / 4.
        assert_eq!(tally.charge(), Charge { tokens: 920 + 1_200 + 101, estimated_steps: 1 });
        // A report after the step closed replaces its estimate.
        tally.add_usage(None, &usage(1_100, 50));
        assert_eq!(tally.charge(), Charge { tokens: 920 + 1_150, estimated_steps: 0 });
    }
}
