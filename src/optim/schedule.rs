//! Learning-rate schedules: constant, linear warm-up then constant, linear warm-up then cosine decay.
//!
//! Reference: nanoGPT `get_lr` (warm-up + cosine to a floor). The non-obvious decision: by default the
//! schedule is evaluated per stage with the stage's own peak lr and step count, so a multi-stage run
//! (the HARPE recipe's constant lr 2e-5) does not re-warm unless the stage asks for it;
//! `schedule.span = "run"` evaluates it over the whole run instead (global step of total steps, each
//! stage's own peak lr). Warm-up step `s` (0-based) uses `lr * (s + 1) / warmup` so the first step is
//! never a no-op. Not done here: per-group lr.

use crate::config::{ScheduleKind, ScheduleSection, ScheduleSpan};

/// A schedule with its parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub warmup_steps: u64,
    pub min_lr_ratio: f64,
    pub span: ScheduleSpan,
}

/// Where one optimizer step stands in its stage and in the run (0-based steps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub stage_step: u64,
    pub stage_steps: u64,
    pub step: u64,
    pub total_steps: u64,
}

impl ScheduleSection {
    /// `[schedule]` as a `Schedule` (here, not in config: config names no module above it).
    pub fn schedule(&self) -> Schedule {
        Schedule { kind: self.kind, warmup_steps: self.warmup_steps, min_lr_ratio: self.min_lr_ratio, span: self.span }
    }
}

impl Schedule {
    /// Learning rate of the step at `at` with peak `lr`: over the stage or over the run (`span`).
    pub fn lr(&self, lr: f64, at: Progress) -> f64 {
        match self.span {
            ScheduleSpan::Stage => self.lr_at(lr, at.stage_step, at.stage_steps),
            ScheduleSpan::Run => self.lr_at(lr, at.step, at.total_steps),
        }
    }

    /// Learning rate for 0-based `step` of a span of `total` steps with peak `lr`.
    pub fn lr_at(&self, lr: f64, step: u64, total: u64) -> f64 {
        let warm = self.warmup_steps;
        match self.kind {
            ScheduleKind::Constant => lr,
            ScheduleKind::LinearWarmup | ScheduleKind::Cosine if step < warm => lr * (step + 1) as f64 / warm as f64,
            ScheduleKind::LinearWarmup => lr,
            ScheduleKind::Cosine => {
                let span = total.saturating_sub(warm).saturating_sub(1).max(1);
                let progress = ((step - warm) as f64 / span as f64).min(1.0);
                let min = lr * self.min_lr_ratio;
                min + (lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let c =
            Schedule { kind: ScheduleKind::Constant, warmup_steps: 10, min_lr_ratio: 0.1, span: ScheduleSpan::Stage };
        assert_eq!(c.lr_at(2e-5, 0, 100), 2e-5);
        let w = Schedule { kind: ScheduleKind::LinearWarmup, ..c };
        assert!((w.lr_at(1.0, 0, 100) - 0.1).abs() < 1e-12);
        assert!((w.lr_at(1.0, 4, 100) - 0.5).abs() < 1e-12);
        assert_eq!(w.lr_at(1.0, 50, 100), 1.0);
        let k = Schedule { kind: ScheduleKind::Cosine, ..c };
        assert!((k.lr_at(1.0, 10, 111) - 1.0).abs() < 1e-12);
        assert!((k.lr_at(1.0, 60, 111) - 0.55).abs() < 1e-12);
        assert!((k.lr_at(1.0, 110, 111) - 0.1).abs() < 1e-12);
        assert!(k.lr_at(1.0, 30, 111) > k.lr_at(1.0, 31, 111));
    }

    #[test]
    fn a_run_span_sees_the_global_step() {
        let k = Schedule { kind: ScheduleKind::Cosine, warmup_steps: 0, min_lr_ratio: 0.0, span: ScheduleSpan::Stage };
        // the second stage's first step: a fresh cosine per stage, or the middle of the run's
        let at = Progress { stage_step: 0, stage_steps: 50, step: 50, total_steps: 101 };
        assert_eq!(k.lr(1.0, at), 1.0);
        let run = Schedule { span: ScheduleSpan::Run, ..k };
        assert!((run.lr(1.0, at) - 0.5).abs() < 1e-12, "{}", run.lr(1.0, at));
        let last = Progress { stage_step: 50, stage_steps: 51, step: 100, total_steps: 101 };
        assert!(run.lr(1.0, last).abs() < 1e-12);
    }
}
