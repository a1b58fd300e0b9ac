//! Turns by model: what an operator graphs per model and credential. Turns by outcome, errors
//! by code, each step's time to first token and decode time as histograms, tokens in and out.
//!
//! The label sets are bounded by the configuration, not by clients: a turn's model is one the
//! configuration names (a request for another is refused before a turn starts), its credential
//! is that model's, and an error's code is one of the gateway's own (a code a runtime made up
//! counts as `other`). Past [`MAX_MODELS`] models, the rest count as model `other`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::Exposition;
use crate::wire::{ErrorCode, TurnMetrics};

/// Most models counted apart: a configuration of thousands of models would otherwise make
/// thousands of series per figure.
pub const MAX_MODELS: usize = 256;

/// Upper bounds of the time-to-first-token histogram, in seconds (also the classes
/// `GET /metrics/series` counts turns in, src/store/series.rs).
pub const TTFT_BUCKETS: [f64; 13] = [0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0];

/// Upper bounds of the decode-time histogram (first token to a step's end), in seconds.
const DECODE_BUCKETS: [f64; 13] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0];

/// How a turn ended, as the model figures count it.
#[derive(Debug, Clone, Copy)]
pub enum Outcome<'a> {
    Finished,
    Failed(Option<&'a ErrorCode>),
    Aborted,
}

/// The code an error is counted under: the gateway's own, `other` for a runtime's own (any
/// string an agent program prints), `unknown` for none.
pub fn code_label(code: Option<&ErrorCode>) -> &'static str {
    code.map_or("unknown", ErrorCode::label)
}

struct Histogram<const N: usize> {
    bounds: &'static [f64; N],
    buckets: [u64; N],
    count: u64,
    sum: f64,
}

impl<const N: usize> Histogram<N> {
    fn new(bounds: &'static [f64; N]) -> Histogram<N> {
        Histogram { bounds, buckets: [0; N], count: 0, sum: 0.0 }
    }

    fn observe(&mut self, seconds: f64) {
        for (bucket, bound) in self.buckets.iter_mut().zip(self.bounds) {
            if seconds <= *bound {
                *bucket += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut Exposition, name: &str, labels: &str) {
        for (bucket, bound) in self.buckets.iter().zip(self.bounds) {
            out.sample(&format!("{name}_bucket"), &format!("{labels},le=\"{bound}\""), bucket);
        }
        out.sample(&format!("{name}_bucket"), &format!("{labels},le=\"+Inf\""), self.count);
        out.sample(&format!("{name}_sum"), labels, self.sum);
        out.sample(&format!("{name}_count"), labels, self.count);
    }
}

/// One model's turns.
struct ModelTurns {
    finished: u64,
    failed: u64,
    aborted: u64,
    errors: BTreeMap<&'static str, u64>,
    input_tokens: u64,
    output_tokens: u64,
    ttft: Histogram<{ TTFT_BUCKETS.len() }>,
    decode: Histogram<{ DECODE_BUCKETS.len() }>,
}

impl Default for ModelTurns {
    fn default() -> ModelTurns {
        ModelTurns {
            finished: 0,
            failed: 0,
            aborted: 0,
            errors: BTreeMap::new(),
            input_tokens: 0,
            output_tokens: 0,
            ttft: Histogram::new(&TTFT_BUCKETS),
            decode: Histogram::new(&DECODE_BUCKETS),
        }
    }
}

/// Every model's turns, by its `<credential>/<model>` name.
#[derive(Default)]
pub struct Models(Mutex<BTreeMap<String, ModelTurns>>);

impl Models {
    /// Counts a sealed turn of `model` (its name as the gateway lists it).
    pub fn turn_ended(&self, model: &str, outcome: Outcome<'_>, metrics: &TurnMetrics) {
        let mut models = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let key = if models.contains_key(model) || models.len() < MAX_MODELS { model } else { "other" };
        // A model seen before is looked up, not allocated again: this runs at every seal.
        if !models.contains_key(key) {
            models.insert(key.to_owned(), ModelTurns::default());
        }
        let turns = models.get_mut(key).expect("inserted above");
        match outcome {
            Outcome::Finished => turns.finished += 1,
            Outcome::Aborted => turns.aborted += 1,
            Outcome::Failed(code) => {
                turns.failed += 1;
                *turns.errors.entry(code_label(code)).or_default() += 1;
            }
        }
        turns.input_tokens = turns.input_tokens.saturating_add(metrics.usage.input_tokens);
        turns.output_tokens = turns.output_tokens.saturating_add(metrics.usage.output_tokens);
        for step in &metrics.steps {
            if let Some(ttft) = step.ttft_ms {
                turns.ttft.observe(ttft as f64 / 1e3);
            }
            if let Some(decode) = step.decode_ms {
                turns.decode.observe(decode as f64 / 1e3);
            }
        }
    }

    pub(super) fn render(&self, out: &mut Exposition) {
        let models = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let labels: Vec<(String, &ModelTurns)> = models
            .iter()
            .map(|(model, turns)| {
                let credential = model.split_once('/').map_or(model.as_str(), |(c, _)| c);
                let labels = format!(
                    "model=\"{}\",credential=\"{}\"",
                    super::label_value(model),
                    super::label_value(credential)
                );
                (labels, turns)
            })
            .collect();
        out.family("dispatch_model_turns_total", "counter", "Turns sealed, by model, credential and outcome.");
        for (labels, turns) in &labels {
            for (outcome, n) in [("finished", turns.finished), ("failed", turns.failed), ("aborted", turns.aborted)] {
                out.sample("dispatch_model_turns_total", &format!("{labels},outcome=\"{outcome}\""), n);
            }
        }
        out.family(
            "dispatch_model_errors_total",
            "counter",
            "Failed turns, by model, credential and error code (a runtime's own codes count as other).",
        );
        for (labels, turns) in &labels {
            for (code, n) in &turns.errors {
                out.sample("dispatch_model_errors_total", &format!("{labels},code=\"{code}\""), n);
            }
        }
        out.family(
            "dispatch_model_tokens_total",
            "counter",
            "Tokens of sealed turns as their runtimes reported them, by model, credential and direction.",
        );
        for (labels, turns) in &labels {
            for (direction, n) in [("input", turns.input_tokens), ("output", turns.output_tokens)] {
                out.sample("dispatch_model_tokens_total", &format!("{labels},direction=\"{direction}\""), n);
            }
        }
        out.family(
            "dispatch_model_ttft_seconds",
            "histogram",
            "Each step's time to its first token, by model and credential.",
        );
        for (labels, turns) in &labels {
            turns.ttft.render(out, "dispatch_model_ttft_seconds", labels);
        }
        out.family(
            "dispatch_model_decode_seconds",
            "histogram",
            "Each step's decode time (its first token to its end), by model and credential.",
        );
        for (labels, turns) in &labels {
            turns.decode.render(out, "dispatch_model_decode_seconds", labels);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtimes_own_codes_and_models_past_the_cap_make_no_new_series() {
        let models = Models::default();
        let metrics: TurnMetrics = serde_json::from_value(serde_json::json!({
            "turnId": "t", "usage": {"inputTokens": 3, "outputTokens": 5}, "steps": []
        }))
        .unwrap();
        for i in 0..MAX_MODELS + 10 {
            let code = ErrorCode::Other(format!("made-up-{i}"));
            models.turn_ended(&format!("c/m{i}"), Outcome::Failed(Some(&code)), &metrics);
        }
        models.turn_ended("c/m0", Outcome::Failed(Some(&ErrorCode::AgentExit)), &metrics);
        let held = models.0.lock().unwrap();
        assert_eq!(held.len(), MAX_MODELS + 1, "the models past the cap count as one");
        assert_eq!(held["other"].failed, 10);
        assert_eq!(held["c/m0"].errors.keys().copied().collect::<Vec<_>>(), ["agent-exit", "other"]);
        assert_eq!(held["c/m0"].output_tokens, 10);
    }
}
