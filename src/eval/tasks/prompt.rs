//! Few-shot selection and the context string of one document, as lm-evaluation-harness 0.4.13 builds them.
//!
//! Reference: `api/samplers.py` (`ContextSampler.sample`, `FirstNSampler.sample`, `rm_eval_doc`),
//! `api/task.py` `ConfigurableTask.fewshot_context` + `build_qa_turn`, `api/utils.py` `Message`,
//! `maybe_delimit`; `evaluator.py` `simple_evaluate(fewshot_random_seed=1234)` -> `set_fewshot_seed`.
//! The rules, pinned:
//! - One `random.Random(seed)` per task (seed 1234 unless `--seed`), drawn from once per evaluated
//!   document in document order: `sample(pool, n)`; when the YAML's `fewshot_split` equals its
//!   `test_split` (HellaSwag, PIQA, TriviaQA: both unset) it draws n + 1, drops rows equal to the
//!   evaluated document and keeps the first n (and redraws n from the pool without it if that left
//!   fewer). MMLU's `first_n` takes the first n rows of `dev`, no randomness.
//! - context = description + for each shot: text + target_delimiter (" ") + answer + fewshot_delimiter
//!   ("\n\n"), then the document's text (no delimiter after it). The answer is `choices[gold]`, or
//!   TriviaQA's first alias.
//!
//! Not done here: chat templates, system instructions, `gen_prefix` (none of these tasks uses one).
use crate::eval::pyrandom::PyRandom;
use crate::eval::tasks::{Doc, Sampler, TaskSpec};
use anyhow::{bail, Result};

/// `target_delimiter` (TaskConfig default; triviaqa sets the same " ").
pub const TARGET_DELIMITER: &str = " ";
/// `simple_evaluate(fewshot_random_seed=1234)`.
pub const DEFAULT_SEED: i64 = 1234;
/// `fewshot_delimiter` (TaskConfig default).
pub const FEWSHOT_DELIMITER: &str = "\n\n";

/// The few-shot pool of one task and its generator.
pub struct FewshotSampler {
    pool: Vec<Doc>,
    rnd: PyRandom,
    sampler: Sampler,
    excludes_doc: bool,
    task: String,
    split: &'static str,
}

impl FewshotSampler {
    /// The sampler over the few-shot split's documents, seeded as `set_fewshot_seed(seed)`.
    pub fn new(spec: &TaskSpec, pool: Vec<Doc>, seed: i64) -> FewshotSampler {
        FewshotSampler {
            pool,
            rnd: PyRandom::new(seed),
            sampler: spec.sampler,
            excludes_doc: spec.fewshot_excludes_doc,
            task: spec.name.clone(),
            split: spec.fewshot_split,
        }
    }

    fn draw(&mut self, idx: &[usize], k: usize) -> Result<Vec<usize>> {
        if k > idx.len() {
            bail!(
                "{}: {k} few-shot examples asked from the `{}` split, which has {}\nhint: pass a smaller --shots or \
                 give the split more records",
                self.task,
                self.split,
                idx.len()
            );
        }
        Ok(self.rnd.sample_indices(idx.len(), k).into_iter().map(|i| idx[i]).collect())
    }

    /// The indices into the pool of the `n` shots for `doc` (advancing the generator as the harness does).
    pub fn sample(&mut self, n: usize, doc: &Doc) -> Result<Vec<usize>> {
        if n == 0 {
            return Ok(vec![]);
        }
        let all: Vec<usize> = (0..self.pool.len()).collect();
        match self.sampler {
            Sampler::FirstN => {
                let pool: Vec<usize> = if self.excludes_doc {
                    all.into_iter().filter(|&i| self.pool[i].raw != doc.raw).collect()
                } else {
                    all
                };
                if n > pool.len() {
                    bail!(
                        "{}: {n} few-shot examples asked from the `{}` split, which has {}\nhint: pass a smaller --shots",
                        self.task,
                        self.split,
                        pool.len()
                    );
                }
                Ok(pool[..n].to_vec())
            }
            Sampler::Random if !self.excludes_doc => self.draw(&all, n),
            Sampler::Random => {
                if n + 1 > all.len() {
                    bail!(
                        "{}: --shots {n} needs {} records in the `{}` split (the harness draws one extra to drop the \
                         evaluated document), which has {}\nhint: pass a smaller --shots or give the split more records",
                        self.task,
                        n + 1,
                        self.split,
                        all.len()
                    );
                }
                let drawn = self.draw(&all, n + 1)?;
                let mut res: Vec<usize> = drawn.into_iter().filter(|&i| self.pool[i].raw != doc.raw).collect();
                res.truncate(n);
                if res.len() < n {
                    let pool: Vec<usize> = (0..self.pool.len()).filter(|&i| self.pool[i].raw != doc.raw).collect();
                    res = self.draw(&pool, n)?;
                }
                Ok(res)
            }
        }
    }

    /// A pool document.
    pub fn doc(&self, i: usize) -> &Doc {
        &self.pool[i]
    }
}

/// The context string of `doc` after `shots`.
pub fn context(description: &str, shots: &[&Doc], doc: &Doc) -> String {
    let mut s = description.to_string();
    for d in shots {
        s.push_str(&d.text);
        s.push_str(TARGET_DELIMITER);
        s.push_str(d.answer_text());
        s.push_str(FEWSHOT_DELIMITER);
    }
    s.push_str(&doc.text);
    s
}
