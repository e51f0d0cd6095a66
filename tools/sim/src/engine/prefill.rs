//! Colocated prefill ([`super::Colocated`]): what each rank prefills in a step, and the KV its
//! prompt part way through holds.
//!
//! Separate from the step loop in [`super::simulate_deciders`], which asks it for each rank's
//! budget and reads back each rank's `(L, n, P)`: the chunking rule reads on its own, and the
//! decode-only path carries none of this state.

use super::*;

/// The prefill state of a colocated run, per rank.
pub(super) struct Prefill {
    chunk: u32,
    /// The request part way through its prompt, with the prompt tokens done once the current
    /// step has run (at most one per rank: a rank runs the prompt it started first).
    partial: Vec<Option<(u32, u32)>>,
    /// KV tokens of that prompt's chunks completed before the current step.
    kv: Vec<u64>,
    /// Prompt tokens run in the current step (P_g).
    tokens: Vec<u64>,
    /// Prompts whose last chunk runs in the current step: they write their first token.
    first: Vec<u32>,
}

impl Prefill {
    pub(super) fn new(co: Colocated, ranks: usize) -> Prefill {
        Prefill {
            chunk: co.chunk.max(1),
            partial: vec![None; ranks],
            kv: vec![0; ranks],
            tokens: vec![0; ranks],
            first: vec![0; ranks],
        }
    }

    /// Opens rank `w`'s step: it continues the prompt it is part way through (`prompt(i)` is
    /// request i's prompt length). Returns the budget left for new requests; a request whose
    /// prompt completes is pushed onto `completed`.
    pub(super) fn begin(
        &mut self,
        w: usize,
        prompt: impl Fn(u32) -> u32,
        completed: &mut Vec<u32>,
    ) -> u32 {
        self.tokens[w] = 0;
        self.first[w] = 0;
        match self.partial[w].take() {
            Some((i, done)) => self.run(w, i, prompt(i) - done, done, self.chunk, completed),
            None => self.chunk,
        }
    }

    /// Request `i` (a `prompt`-token prompt) takes a slot on rank `w` and runs its first chunk
    /// from `budget`. Returns the budget left.
    pub(super) fn start(
        &mut self,
        w: usize,
        i: u32,
        prompt: u32,
        budget: u32,
        completed: &mut Vec<u32>,
    ) -> u32 {
        self.run(w, i, prompt, 0, budget, completed)
    }

    fn run(
        &mut self,
        w: usize,
        i: u32,
        rest: u32,
        done: u32,
        budget: u32,
        completed: &mut Vec<u32>,
    ) -> u32 {
        let x = rest.min(budget);
        self.tokens[w] += u64::from(x);
        if x == rest {
            self.first[w] += 1;
            completed.push(i);
        } else {
            self.partial[w] = Some((i, done + x));
        }
        budget - x
    }

    /// Rank `w` in the current step: the KV it reads (its decoding requests' in σ plus the
    /// completed chunks of its partial prompt), the tokens it writes (its decoding requests and
    /// the prompts completing now) and the prompt tokens it runs.
    pub(super) fn rank(&self, w: usize, info: &WorkerInfo) -> (u64, u32, u64) {
        (
            info.running_load + self.kv[w],
            info.running + self.first[w],
            self.tokens[w],
        )
    }

    /// The step has run: the partial prompts' chunks of this step are KV now.
    pub(super) fn end_step(&mut self) {
        for (kv, p) in self.kv.iter_mut().zip(&self.partial) {
            *kv = p.map_or(0, |(_, done)| u64::from(done));
        }
    }
}
