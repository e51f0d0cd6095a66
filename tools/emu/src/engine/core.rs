//! The lockstep model of G data-parallel decode ranks, with no I/O and no clock: each call to
//! [`Lockstep::begin_step`] admits queued requests into free slots and measures the loads the
//! step runs at; [`Lockstep::finish_step`] emits one token for every running request. The async
//! driver ([`super::driver`]) sleeps for the step time in between.

use std::collections::VecDeque;

/// The step-time model `T = a·max_g L_g + b` (milliseconds, before `--time-scale`); the
/// request term `c·max_g n_g` is the [`Lockstep`]'s (`with_request_cost`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepModel {
    /// a: ms per KV token on the most loaded rank.
    pub a_ms_per_token: f64,
    /// b: fixed ms per step.
    pub b_ms: f64,
}

impl StepModel {
    /// Model step time in ms for a step whose most loaded rank holds `max_load` KV tokens.
    pub fn step_ms(&self, max_load: u64) -> f64 {
        self.a_ms_per_token * max_load as f64 + self.b_ms
    }
}

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
}

impl<N> Slot<N> {
    /// KV load of the request at its next step: s_i + j (j tokens generated so far).
    pub fn load(&self) -> u64 {
        u64::from(self.prompt) + u64::from(self.generated)
    }
}

#[derive(Debug)]
struct Rank<N> {
    running: Vec<Slot<N>>,
    queue: VecDeque<Slot<N>>,
}

/// The loads one step ran at.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// L_g for every rank, during this step.
    pub loads: Vec<u64>,
    /// Running requests per rank.
    pub running: Vec<u32>,
    /// Model step time, ms (a·max L + c·max n + b).
    pub model_ms: f64,
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
}

/// G ranks with B slots each and a FIFO local queue per rank.
#[derive(Debug)]
pub struct Lockstep<N> {
    ranks: Vec<Rank<N>>,
    slots: usize,
    model: StepModel,
    /// c: ms per running request on the rank that runs the most (0: the paper's model).
    c_ms_per_request: f64,
}

impl<N: Notify> Lockstep<N> {
    pub fn new(ranks: usize, slots: usize, model: StepModel) -> Self {
        Lockstep {
            ranks: (0..ranks)
                .map(|_| Rank {
                    running: Vec::new(),
                    queue: VecDeque::new(),
                })
                .collect(),
            slots: slots.max(1),
            model,
            c_ms_per_request: 0.0,
        }
    }

    /// Steps also pay `c` ms per running request on the rank that runs the most:
    /// `T = a·max L + c·max n + b` (what `br-sim calibrate` fits from the step log).
    pub fn with_request_cost(mut self, c_ms_per_request: f64) -> Self {
        self.c_ms_per_request = c_ms_per_request;
        self
    }

    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Queues a request on `rank` (it takes a slot at the next step boundary, in FIFO order).
    /// Returns the slot back if the rank does not exist.
    pub fn submit(&mut self, rank: usize, slot: Slot<N>) -> Result<(), Slot<N>> {
        match self.ranks.get_mut(rank) {
            Some(r) => {
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
            .any(|r| !r.running.is_empty() || !r.queue.is_empty())
    }

    /// (running, queued) per rank.
    pub fn occupancy(&self) -> Vec<(usize, usize)> {
        self.ranks
            .iter()
            .map(|r| (r.running.len(), r.queue.len()))
            .collect()
    }

    /// Drops requests whose client went away, admits queued requests into free slots (FIFO)
    /// and returns the loads this step runs at. `None` if nothing runs.
    pub fn begin_step(&mut self) -> Option<StepRecord> {
        for r in &mut self.ranks {
            r.running.retain(|s| s.notify.alive());
            r.queue.retain(|s| s.notify.alive());
            while r.running.len() < self.slots {
                let Some(mut s) = r.queue.pop_front() else {
                    break;
                };
                s.notify.notify(Progress {
                    generated: 0,
                    running: true,
                    done: false,
                });
                r.running.push(s);
            }
        }
        if self.ranks.iter().all(|r| r.running.is_empty()) {
            return None;
        }
        let loads: Vec<u64> = self
            .ranks
            .iter()
            .map(|r| r.running.iter().map(Slot::load).sum())
            .collect();
        let running: Vec<u32> = self.ranks.iter().map(|r| r.running.len() as u32).collect();
        let max = loads.iter().copied().max().unwrap_or(0);
        let mut model_ms = self.model.step_ms(max);
        // c = 0 leaves the two-term model's arithmetic as it was
        if self.c_ms_per_request != 0.0 {
            let n = running.iter().copied().max().unwrap_or(0);
            model_ms += self.c_ms_per_request * f64::from(n);
        }
        Some(StepRecord {
            loads,
            running,
            model_ms,
        })
    }

    /// The step's time has passed: every running request emits one token; requests that
    /// reached their output length leave their slot.
    pub fn finish_step(&mut self) {
        for r in &mut self.ranks {
            for s in &mut r.running {
                s.generated += 1;
                let done = s.generated >= s.max_tokens;
                s.notify.notify(Progress {
                    generated: s.generated,
                    running: !done,
                    done,
                });
            }
            r.running.retain(|s| s.generated < s.max_tokens);
        }
    }
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
        }
    }

    const M: StepModel = StepModel {
        a_ms_per_token: 0.5,
        b_ms: 10.0,
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
            e.finish_step();
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
        let mut e = Lockstep::new(2, 4, M).with_request_cost(2.0);
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
        e.finish_step();
        let _ = e.begin_step().unwrap();
        e.finish_step();
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
        e.finish_step();
        *gone.1.borrow_mut() = true;
        let rec = e.begin_step().unwrap();
        assert_eq!(rec.loads, vec![30]);
        e.finish_step();
        assert!(e.begin_step().is_none());
    }

    #[test]
    fn idle_engine_takes_no_step() {
        let mut e: Lockstep<Rec> = Lockstep::new(3, 1, M);
        assert!(e.begin_step().is_none());
        assert!(e.submit(5, slot(1, 1, 1, &Rec::default())).is_err());
    }
}
