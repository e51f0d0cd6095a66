//! The lockstep model of G data-parallel ranks, with no I/O and no clock: each call to
//! [`Lockstep::begin_step`] admits queued requests into free slots and measures the loads the
//! step runs at; [`Lockstep::finish_step`] emits one token for every running request. The async
//! driver ([`super::driver`]) sleeps for the step time in between.
//!
//! The step time is br-core's [`StepModel`], the one the twin runs: `a·max L + c·max n + b`,
//! plus `p·max P` with colocated prefill ([`Lockstep::with_colocated`]). Without it the ranks
//! are a decode tier: a request's prompt arrives as KV and its first step writes its first
//! token. With it, each rank runs up to `chunk` prompt tokens per step, first come, first
//! served: first the prompt it is part way through, then requests from its queue while it has
//! free slots and budget left (SGLang's and vLLM's default chunked prefill). A request holds
//! its slot from its first chunk, its KV grows by each chunk as the chunk completes, and the
//! step that runs its last chunk writes its first token; every rank waits for the rank that
//! prefills the most. This is br-sim's `--colocated` model, step for step.

use std::collections::VecDeque;

pub use br_core::StepModel;

/// What the engine tells the owner of a request after each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// Tokens generated so far.
    pub generated: u32,
    /// Whether the request holds a slot (false while it waits in the rank's local queue).
    pub running: bool,
    /// The request generated all its tokens and left its slot.
    pub done: bool,
}

/// Something the core can notify about a request's progress (a `watch::Sender` in the
/// driver, a plain recorder in tests). `alive` false means nobody listens any more: the
/// client went away and the request is aborted.
pub trait Notify {
    fn notify(&mut self, p: Progress);
    fn alive(&self) -> bool;
}

/// One request on a rank.
#[derive(Debug)]
pub struct Slot<N> {
    pub id: u64,
    /// s_i, prompt tokens.
    pub prompt: u32,
    /// o_i: the request generates exactly this many tokens (`max_tokens` with ignore_eos).
    pub max_tokens: u32,
    pub generated: u32,
    pub notify: N,
    /// The engine's model clock (ms) when the request reached it (set by [`Lockstep::submit`]).
    pub arrived_ms: f64,
}

impl<N> Slot<N> {
    /// KV load of the request at its next step: s_i + j (j tokens generated so far).
    pub fn load(&self) -> u64 {
        u64::from(self.prompt) + u64::from(self.generated)
    }
}

#[derive(Debug)]
struct Rank<N> {
    /// Requests that decode (their prompt is KV).
    running: Vec<Slot<N>>,
    queue: VecDeque<Slot<N>>,
    /// Colocated prefill: the request part way through its prompt, with the prompt tokens
    /// done once the current step has run, and the KV its chunks held before the step.
    partial: Option<(Slot<N>, u32)>,
    partial_kv: u64,
    /// Requests whose last prompt chunk runs in the current step: they write their first token.
    completing: Vec<Slot<N>>,
    /// Prompt tokens run in the current step (P_g).
    prefill: u64,
}

impl<N> Rank<N> {
    fn holds(&self) -> usize {
        self.running.len() + self.completing.len() + usize::from(self.partial.is_some())
    }
}

/// Colocated prefill: the ranks run prompts in the same steps as their decode batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Colocated {
    /// Prompt tokens a rank may run per step (the engine's chunked-prefill budget).
    pub chunk: u32,
}

/// The loads one step ran at.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// L_g for every rank, during this step.
    pub loads: Vec<u64>,
    /// Requests per rank that write a token in this step.
    pub running: Vec<u32>,
    /// Prompt tokens per rank prefilled in this step (all 0 without colocated prefill).
    pub prefill: Vec<u64>,
    /// Model step time, ms (a·max L + p·max P + c·max n + b).
    pub model_ms: f64,
    /// The step's balance ratio, `Σ_g work_g / (G · max_g work_g)` with `work_g = a·L_g +
    /// p·P_g + c·n_g` (each rank's share of the step time; 1 when no rank works): br-sim's
    /// `balance%`, see [`balance_ratio`].
    pub balance: f64,
}

impl StepRecord {
    pub fn max_load(&self) -> u64 {
        self.loads.iter().copied().max().unwrap_or(0)
    }
    pub fn min_load(&self) -> u64 {
        self.loads.iter().copied().min().unwrap_or(0)
    }
    pub fn sum_load(&self) -> u64 {
        self.loads.iter().sum()
    }
    /// The most running requests on one rank (n of the step model's request term).
    pub fn max_running(&self) -> u32 {
        self.running.iter().copied().max().unwrap_or(0)
    }
    /// The most prompt tokens one rank prefilled (P of the step model's prefill term).
    pub fn max_prefill(&self) -> u64 {
        self.prefill.iter().copied().max().unwrap_or(0)
    }
}

/// G ranks with B slots each and a FIFO local queue per rank.
#[derive(Debug)]
pub struct Lockstep<N> {
    ranks: Vec<Rank<N>>,
    slots: usize,
    model: StepModel,
    colocated: Option<Colocated>,
    /// Model time (ms) at the end of the last step.
    clock_ms: f64,
    /// Time to first token (model ms, from arrival) of the requests whose first token the
    /// last step wrote.
    first_tokens: Vec<f64>,
}

impl<N: Notify> Lockstep<N> {
    pub fn new(ranks: usize, slots: usize, model: StepModel) -> Self {
        Lockstep {
            ranks: (0..ranks)
                .map(|_| Rank {
                    running: Vec::new(),
                    queue: VecDeque::new(),
                    partial: None,
                    partial_kv: 0,
                    completing: Vec::new(),
                    prefill: 0,
                })
                .collect(),
            slots: slots.max(1),
            model,
            colocated: None,
            clock_ms: 0.0,
            first_tokens: Vec::new(),
        }
    }

    /// The ranks prefill too (module docs), `chunk` prompt tokens per rank per step.
    pub fn with_colocated(mut self, colocated: Colocated) -> Self {
        self.colocated = Some(Colocated {
            chunk: colocated.chunk.max(1),
        });
        self
    }

    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Queues a request on `rank` (it takes a slot at the next step boundary, in FIFO order)
    /// and stamps its arrival on the model clock. Returns the slot back if the rank does not
    /// exist.
    pub fn submit(&mut self, rank: usize, mut slot: Slot<N>) -> Result<(), Slot<N>> {
        match self.ranks.get_mut(rank) {
            Some(r) => {
                slot.arrived_ms = self.clock_ms;
                r.queue.push_back(slot);
                Ok(())
            }
            None => Err(slot),
        }
    }

    /// Whether any rank runs or queues anything.
    pub fn busy(&self) -> bool {
        self.ranks
            .iter()
            .any(|r| r.holds() > 0 || !r.queue.is_empty())
    }

    /// (running, queued) per rank; a request part way through its prompt counts as running.
    pub fn occupancy(&self) -> Vec<(usize, usize)> {
        self.ranks
            .iter()
            .map(|r| (r.holds(), r.queue.len()))
            .collect()
    }

    /// Time to first token (model ms from arrival) of each request whose first token the last
    /// finished step wrote.
    pub fn first_tokens(&self) -> &[f64] {
        &self.first_tokens
    }

    /// Drops requests whose client went away, admits queued requests into free slots (FIFO;
    /// colocated: within the prefill budget) and returns the loads this step runs at. `None`
    /// if nothing runs.
    pub fn begin_step(&mut self) -> Option<StepRecord> {
        for r in &mut self.ranks {
            r.running.retain(|s| s.notify.alive());
            r.queue.retain(|s| s.notify.alive());
            if r.partial.as_ref().is_some_and(|(s, _)| !s.notify.alive()) {
                r.partial = None;
                r.partial_kv = 0;
            }
            match self.colocated {
                None => {
                    while r.running.len() < self.slots {
                        let Some(mut s) = r.queue.pop_front() else {
                            break;
                        };
                        started(&mut s);
                        r.running.push(s);
                    }
                }
                Some(co) => prefill_step(r, co.chunk, self.slots),
            }
        }
        if self.ranks.iter().all(|r| r.holds() == 0) {
            return None;
        }
        let loads: Vec<u64> = self
            .ranks
            .iter()
            .map(|r| r.running.iter().map(Slot::load).sum::<u64>() + r.partial_kv)
            .collect();
        let running: Vec<u32> = self
            .ranks
            .iter()
            .map(|r| (r.running.len() + r.completing.len()) as u32)
            .collect();
        let prefill: Vec<u64> = self.ranks.iter().map(|r| r.prefill).collect();
        let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
        let model_ms = self.model.step_ms_with_prefill(
            max(&loads),
            max(&prefill),
            running.iter().copied().max().unwrap_or(0),
        );
        let balance = balance_ratio(&self.model, &loads, &prefill, &running);
        Some(StepRecord {
            loads,
            running,
            prefill,
            model_ms,
            balance,
        })
    }

    /// The step (of `model_ms`) has run: every decoding request and every prompt that completed
    /// emits one token; requests that reached their output length leave their slot.
    pub fn finish_step(&mut self, model_ms: f64) {
        self.clock_ms += model_ms;
        self.first_tokens.clear();
        let (clock_ms, first_tokens) = (self.clock_ms, &mut self.first_tokens);
        for r in &mut self.ranks {
            // the prompts that completed decode from the next step on
            let mut completed = std::mem::take(&mut r.completing);
            for s in &mut r.running {
                write_token(s, clock_ms, first_tokens);
            }
            r.running.retain(|s| s.generated < s.max_tokens);
            for mut s in completed.drain(..) {
                if !write_token(&mut s, clock_ms, first_tokens) {
                    r.running.push(s);
                }
            }
            r.completing = completed;
            r.partial_kv = r.partial.as_ref().map_or(0, |(_, done)| u64::from(*done));
        }
    }
}

/// The balance ratio of one step, as br-sim defines it (its `balance%`, averaged over steps):
/// `Σ_g work_g / (G · max_g work_g)`, a rank's work its share of the step time, `work_g =
/// a·L_g + p·P_g + c·n_g` with L_g the KV it reads (`loads`), P_g the prompt tokens it prefills
/// (`prefill`, all 0 for a decode tier) and n_g the tokens it writes (`running`). 1 means no
/// rank waits at the barrier; decode-only with c = 0 it is the KV balance `mean L / max L`.
/// A step in which no rank works counts as balanced (1). Computed by the same operations, in
/// the same order, as br-sim's step loop, so an engine and its twin that run the same steps
/// report the same ratio.
pub fn balance_ratio(model: &StepModel, loads: &[u64], prefill: &[u64], running: &[u32]) -> f64 {
    let g = loads.len();
    let (mut work_max, mut work_sum) = (0.0f64, 0.0f64);
    for (w, &l) in loads.iter().enumerate() {
        let p_w = prefill.get(w).copied().unwrap_or(0);
        let n_w = running.get(w).copied().unwrap_or(0);
        let work = model.a_ms_per_token * l as f64
            + model.p_ms_per_prefill_token * p_w as f64
            + model.c_ms_per_request * f64::from(n_w);
        work_max = work_max.max(work);
        work_sum += work;
    }
    if work_max > 0.0 {
        work_sum / (g as f64 * work_max)
    } else {
        1.0
    }
}

/// `s` writes a token in the step that ended at `clock_ms`: its owner learns it, and its first
/// token's time from arrival goes to `first_tokens`. Returns whether that was its last.
fn write_token<N: Notify>(s: &mut Slot<N>, clock_ms: f64, first_tokens: &mut Vec<f64>) -> bool {
    s.generated += 1;
    if s.generated == 1 {
        first_tokens.push(clock_ms - s.arrived_ms);
    }
    let done = s.generated >= s.max_tokens;
    s.notify.notify(Progress {
        generated: s.generated,
        running: !done,
        done,
    });
    done
}

/// A request takes a slot: its owner learns it runs.
fn started<N: Notify>(s: &mut Slot<N>) {
    s.notify.notify(Progress {
        generated: 0,
        running: true,
        done: false,
    });
}

/// One rank's prefill for the coming step: the prompt part way through first, then queued
/// requests while a slot and budget are left (a prompt of 0 tokens needs no budget).
fn prefill_step<N: Notify>(r: &mut Rank<N>, chunk: u32, slots: usize) {
    r.prefill = 0;
    let mut budget = chunk;
    if let Some((s, done)) = r.partial.take() {
        budget = run_chunk(r, s, done, budget);
    }
    while r.holds() < slots {
        let Some(front) = r.queue.front() else { break };
        if budget == 0 && front.prompt > 0 {
            break;
        }
        let Some(mut s) = r.queue.pop_front() else {
            break;
        };
        started(&mut s);
        budget = run_chunk(r, s, 0, budget);
    }
}

/// Runs up to `budget` more of `s`'s prompt (`done` tokens of it already KV); returns the
/// budget left.
fn run_chunk<N>(r: &mut Rank<N>, s: Slot<N>, done: u32, budget: u32) -> u32 {
    let x = (s.prompt - done).min(budget);
    r.prefill += u64::from(x);
    if done + x == s.prompt {
        r.completing.push(s);
    } else {
        r.partial = Some((s, done + x));
    }
    budget - x
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    #[derive(Clone, Default, Debug)]
    struct Rec(Rc<RefCell<Vec<Progress>>>, Rc<RefCell<bool>>);
    impl Notify for Rec {
        fn notify(&mut self, p: Progress) {
            self.0.borrow_mut().push(p);
        }
        fn alive(&self) -> bool {
            !*self.1.borrow()
        }
    }

    fn slot(id: u64, prompt: u32, out: u32, n: &Rec) -> Slot<Rec> {
        Slot {
            id,
            prompt,
            max_tokens: out,
            generated: 0,
            notify: n.clone(),
            arrived_ms: 0.0,
        }
    }

    const M: StepModel = StepModel {
        a_ms_per_token: 0.5,
        b_ms: 10.0,
        c_ms_per_request: 0.0,
        p_ms_per_prefill_token: 0.0,
    };

    #[test]
    fn step_time_follows_a_max_plus_b() {
        let mut e = Lockstep::new(2, 4, M);
        let n = Rec::default();
        e.submit(0, slot(1, 100, 3, &n)).unwrap();
        e.submit(1, slot(2, 40, 3, &n)).unwrap();
        e.submit(1, slot(3, 20, 1, &n)).unwrap();
        let mut steps = Vec::new();
        while let Some(rec) = e.begin_step() {
            steps.push(rec);
            e.finish_step(0.0);
        }
        // Loads grow by one token per running request per step; the barrier waits for rank 0.
        let loads: Vec<Vec<u64>> = steps.iter().map(|s| s.loads.clone()).collect();
        assert_eq!(loads, vec![vec![100, 60], vec![101, 41], vec![102, 42]]);
        for s in &steps {
            assert_eq!(s.model_ms, 0.5 * s.max_load() as f64 + 10.0);
        }
        assert!(!e.busy());
    }

    #[test]
    fn the_request_term_pays_c_per_request_on_the_busiest_rank() {
        let mut e = Lockstep::new(
            2,
            4,
            StepModel {
                c_ms_per_request: 2.0,
                ..M
            },
        );
        let n = Rec::default();
        e.submit(0, slot(1, 100, 1, &n)).unwrap();
        for id in 2..5 {
            e.submit(1, slot(id, 10, 1, &n)).unwrap();
        }
        let rec = e.begin_step().unwrap();
        // rank 0 holds the most tokens (100), rank 1 the most requests (3)
        assert_eq!((rec.max_load(), rec.max_running()), (100, 3));
        assert_eq!(rec.model_ms, 0.5 * 100.0 + 2.0 * 3.0 + 10.0);
    }

    #[test]
    fn slots_bound_running_and_queue_is_fifo() {
        let mut e = Lockstep::new(1, 2, M);
        let recs: Vec<Rec> = (0..4).map(|_| Rec::default()).collect();
        for (i, r) in recs.iter().enumerate() {
            e.submit(0, slot(i as u64, 10, 2, r)).unwrap();
        }
        let first = e.begin_step().unwrap();
        assert_eq!(first.running, vec![2]);
        assert_eq!(e.occupancy(), vec![(2, 2)]);
        e.finish_step(0.0);
        let _ = e.begin_step().unwrap();
        e.finish_step(0.0);
        // The first two finished after 2 tokens; the next two start only now, in order.
        assert!(recs[0].0.borrow().last().unwrap().done);
        assert!(recs[1].0.borrow().last().unwrap().done);
        assert!(recs[2].0.borrow().is_empty());
        let third = e.begin_step().unwrap();
        assert_eq!(third.loads, vec![20]);
        assert!(recs[2].0.borrow()[0].running);
        assert!(recs[3].0.borrow()[0].running);
    }

    #[test]
    fn a_request_whose_client_left_frees_its_slot() {
        let mut e = Lockstep::new(1, 1, M);
        let gone = Rec::default();
        let waiting = Rec::default();
        e.submit(0, slot(1, 10, 100, &gone)).unwrap();
        e.submit(0, slot(2, 30, 1, &waiting)).unwrap();
        e.begin_step().unwrap();
        e.finish_step(0.0);
        *gone.1.borrow_mut() = true;
        let rec = e.begin_step().unwrap();
        assert_eq!(rec.loads, vec![30]);
        e.finish_step(0.0);
        assert!(e.begin_step().is_none());
    }

    #[test]
    fn idle_engine_takes_no_step() {
        let mut e: Lockstep<Rec> = Lockstep::new(3, 1, M);
        assert!(e.begin_step().is_none());
        assert!(e.submit(5, slot(1, 1, 1, &Rec::default())).is_err());
    }

    const P: StepModel = StepModel {
        p_ms_per_prefill_token: 0.01,
        ..M
    };

    /// Runs steps until nothing runs; returns each step's record.
    fn run_all(e: &mut Lockstep<Rec>) -> Vec<StepRecord> {
        let mut steps = Vec::new();
        while let Some(rec) = e.begin_step() {
            e.finish_step(rec.model_ms);
            steps.push(rec);
        }
        steps
    }

    #[test]
    fn a_long_prompt_prefills_in_chunks_before_its_first_token() {
        // 10,000 prompt tokens at 4,096 per step: 4,096 + 4,096 + 1,808, the first token in
        // the third step; the KV read grows by each chunk once it has run.
        let mut e = Lockstep::new(1, 4, P).with_colocated(Colocated { chunk: 4_096 });
        let n = Rec::default();
        e.submit(0, slot(1, 10_000, 2, &n)).unwrap();
        let steps = run_all(&mut e);
        let prefill: Vec<u64> = steps.iter().map(|s| s.prefill[0]).collect();
        assert_eq!(prefill, vec![4_096, 4_096, 1_808, 0]);
        let loads: Vec<u64> = steps.iter().map(|s| s.loads[0]).collect();
        assert_eq!(loads, vec![0, 4_096, 8_192, 10_001]);
        let written: Vec<u32> = steps.iter().map(|s| s.running[0]).collect();
        assert_eq!(written, vec![0, 0, 1, 1]);
        let generated: Vec<u32> = n.0.borrow().iter().map(|p| p.generated).collect();
        // taken into a slot, then 0 tokens for two steps (no report), the first, the last
        assert_eq!(generated, vec![0, 1, 2]);
        // the engine's TTFT is the three steps' model time
        let ttft: f64 = steps[..3].iter().map(|s| s.model_ms).sum();
        assert!(((steps[0].model_ms - (0.01 * 4_096.0 + 10.0)).abs()) < 1e-9);
        let mut again = Lockstep::new(1, 4, P).with_colocated(Colocated { chunk: 4_096 });
        again.submit(0, slot(1, 10_000, 2, &n)).unwrap();
        let mut seen = Vec::new();
        while let Some(rec) = again.begin_step() {
            again.finish_step(rec.model_ms);
            seen.extend_from_slice(again.first_tokens());
        }
        assert_eq!(seen, vec![ttft]);
    }

    #[test]
    fn one_rank_prefilling_slows_every_rank_in_lockstep() {
        let mut e = Lockstep::new(2, 4, P).with_colocated(Colocated { chunk: 2_048 });
        let n = Rec::default();
        // rank 1 decodes a request whose prompt is done in its first step; rank 0 then takes
        // a prompt of 2,048 while rank 1 only decodes
        e.submit(1, slot(1, 100, 10, &n)).unwrap();
        let first = e.begin_step().unwrap();
        assert_eq!(first.prefill, vec![0, 100]);
        e.finish_step(first.model_ms);
        e.submit(0, slot(2, 2_048, 1, &n)).unwrap();
        let rec = e.begin_step().unwrap();
        assert_eq!(rec.prefill, vec![2_048, 0]);
        assert_eq!(rec.loads, vec![0, 101]);
        // every rank's step lasts a·max L + p·max P + b: rank 1 waits for rank 0's chunk
        assert_eq!(rec.model_ms, 0.5 * 101.0 + 0.01 * 2_048.0 + 10.0);
    }

    #[test]
    fn prefill_is_first_come_first_served_within_the_budget_and_the_slots() {
        let mut e = Lockstep::new(1, 3, P).with_colocated(Colocated { chunk: 1_000 });
        let recs: Vec<Rec> = (0..4).map(|_| Rec::default()).collect();
        for (i, (r, prompt)) in recs.iter().zip([300u32, 500, 400, 50]).enumerate() {
            e.submit(0, slot(i as u64, prompt, 5, r)).unwrap();
        }
        // step 1: 300 + 500 complete, 200 of the third's 400 run; the fourth has no slot
        let s1 = e.begin_step().unwrap();
        assert_eq!(s1.prefill, vec![1_000]);
        assert_eq!(s1.running, vec![2]);
        e.finish_step(s1.model_ms);
        assert!(recs[3].0.borrow().is_empty(), "no slot for the fourth");
        // step 2: the third's last 200 first; the two others decode
        let s2 = e.begin_step().unwrap();
        assert_eq!(s2.prefill, vec![200]);
        assert_eq!(s2.loads, vec![301 + 501 + 200]);
        assert_eq!(s2.running, vec![3]);
    }

    #[test]
    fn a_client_that_leaves_mid_prompt_frees_its_slot_and_budget() {
        let mut e = Lockstep::new(1, 1, P).with_colocated(Colocated { chunk: 100 });
        let gone = Rec::default();
        let next = Rec::default();
        e.submit(0, slot(1, 1_000, 5, &gone)).unwrap();
        e.submit(0, slot(2, 50, 1, &next)).unwrap();
        let s1 = e.begin_step().unwrap();
        e.finish_step(s1.model_ms);
        *gone.1.borrow_mut() = true;
        let s2 = e.begin_step().unwrap();
        assert_eq!((s2.prefill.clone(), s2.loads.clone()), (vec![50], vec![0]));
        e.finish_step(s2.model_ms);
        assert!(next.0.borrow().last().unwrap().done);
        assert!(e.begin_step().is_none());
    }

    #[test]
    fn the_balance_ratio_is_the_ranks_work_over_g_times_the_busiest_rank_s() {
        let model = StepModel {
            a_ms_per_token: 0.5,
            b_ms: 10.0,
            c_ms_per_request: 2.0,
            p_ms_per_prefill_token: 0.01,
        };
        // work_g = a·L + p·P + c·n: rank 0 0.5·100 + 0 + 2·2 = 54, rank 1 0.5·50 + 0.01·1000
        // + 2·1 = 37; b is no rank's work
        let r = balance_ratio(&model, &[100, 50], &[0, 1_000], &[2, 1]);
        assert!((r - (54.0 + 37.0) / (2.0 * 54.0)).abs() < 1e-12, "{r}");
        // decode-only with c = 0: the KV balance mean L / max L
        let r = balance_ratio(&M, &[100, 50, 0, 50], &[0; 4], &[1, 1, 0, 1]);
        assert_eq!(r, 50.0 / 100.0);
        // equal work on every rank is 1; a step in which no rank works counts as balanced
        assert_eq!(balance_ratio(&model, &[70, 70], &[5, 5], &[3, 3]), 1.0);
        assert_eq!(balance_ratio(&M, &[0, 0], &[0, 0], &[0, 0]), 1.0);
        // a prefill stall on one rank: the others wait for it
        let r = balance_ratio(&model, &[0, 0, 0, 0], &[4_000, 0, 0, 0], &[0; 4]);
        assert_eq!(r, 0.25);
    }

    #[test]
    fn every_step_records_its_balance_ratio_prefill_included() {
        let mut e = Lockstep::new(2, 4, P).with_colocated(Colocated { chunk: 2_048 });
        let n = Rec::default();
        e.submit(1, slot(1, 100, 10, &n)).unwrap();
        let first = e.begin_step().unwrap();
        // rank 1 prefills 100 tokens, rank 0 nothing: 0.01·100 over 2 × that
        assert_eq!(first.balance, 0.5);
        e.finish_step(first.model_ms);
        e.submit(0, slot(2, 2_048, 1, &n)).unwrap();
        let rec = e.begin_step().unwrap();
        // rank 0 prefills 2,048 (20.48 ms of work), rank 1 reads 101 KV tokens (50.5 ms)
        let want = (0.01 * 2_048.0 + 0.5 * 101.0) / (2.0 * (0.5 * 101.0));
        assert!((rec.balance - want).abs() < 1e-12, "{}", rec.balance);
        assert_eq!(
            rec.balance,
            balance_ratio(&P, &rec.loads, &rec.prefill, &rec.running)
        );
        // a decode tier: the KV balance of the loads the step ran at
        let mut e = Lockstep::new(2, 4, M);
        e.submit(0, slot(1, 100, 3, &n)).unwrap();
        e.submit(1, slot(2, 40, 3, &n)).unwrap();
        let rec = e.begin_step().unwrap();
        assert_eq!(rec.balance, 140.0 / 200.0);
    }

    #[test]
    fn without_colocated_prefill_p_changes_nothing() {
        let run = |model| {
            let mut e = Lockstep::new(2, 2, model);
            let n = Rec::default();
            for (i, (rank, prompt)) in [(0, 900u32), (1, 100), (1, 50), (0, 7)]
                .into_iter()
                .enumerate()
            {
                e.submit(rank, slot(i as u64, prompt, 3 + i as u32, &n))
                    .unwrap();
            }
            run_all(&mut e)
        };
        assert_eq!(run(M), run(P));
    }
}
