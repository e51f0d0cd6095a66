//! [`Classed`]: what [`Hinted`] learns, learned again within each request class the gateway
//! names (`AssignRequest.request_class`: a template, a tenant, tools on or off), so a class
//! whose outputs are alike is predicted from its own lengths and its own hints' error
//! (BR-H's `brh-class`).
//!
//! Separate from [`Hinted`] because it is a table of them and the bookkeeping that maps each
//! class's learning to the cache's sources; the models themselves are Hinted's.

use std::collections::HashMap;

use super::*;

/// Classes a group tells apart by default: the contract asks gateways for tens of keys, and a
/// class costs the lengths it saw plus, once one of its requests carried a hint, Hinted's fixed
/// ratio table (48 KiB), so 64 bound a group's classes to about 3 MiB besides their
/// histograms. Keys beyond it are predicted as
/// if they had none (from the group's whole distribution), never evicted and relearned.
pub const DEFAULT_MAX_CLASSES: usize = 64;

/// A class's predictions read one source, shared by the classes whose table index is the same
/// modulo this (the ids left above the other predictors' in [`SOURCES`]): a finish of one
/// class re-predicts at most the requests of the classes that share its source.
const CLASS_SOURCES: usize = SOURCES - SOURCE_CLASS0 as usize;

/// The class at table index `i`'s source.
fn class_source(i: usize) -> Source {
    SOURCE_CLASS0 + (i % CLASS_SOURCES) as Source
}

/// Predicts a request of a known class from that class's own [`Hinted`] (its Survival by
/// prompt-length octave, its hints' ratios), once the class has `min_samples` finishes, and
/// every other request from a [`Hinted`] over all finishes: requests without a class, of a
/// class seen too seldom so far, or of a class that found the table full (`max_classes`).
///
/// Every finish teaches the group's model; one with a class also teaches its class's. So with
/// no classes at all it predicts exactly as [`Hinted`] does, and a class that explains nothing
/// predicts about as the group does (its own sample of the same distribution).
#[derive(Debug, Clone)]
pub struct Classed {
    group: Hinted,
    /// The classes' models, in the order their first finish came; never shrinks.
    classes: Vec<Hinted>,
    /// Class id → index in `classes`.
    index: HashMap<u64, usize>,
    /// A fresh class's model (cloned on its first finish).
    blank: Hinted,
    max_classes: usize,
    min_samples: u64,
}

/// Which model predicts a request, and what its prediction reads.
enum Model<'a> {
    /// The group's: the request has no class, or its class will never have a table entry.
    Group,
    /// The group's for now: its class may yet become usable (a finish of it then moves the
    /// request to its class's model), so the prediction reads everything.
    GroupForNow,
    /// Its class's, at table index `i`.
    Class(usize, &'a Hinted),
}

impl Classed {
    /// `blank` is the model each class starts from and the group's (Hinted over a
    /// [`Survival`] with the group's prompt buckets); a class predicts once it has
    /// `min_samples` finishes; at most `max_classes` classes (at least 1).
    pub fn new(blank: Hinted, min_samples: u64, max_classes: usize) -> Self {
        Self {
            group: blank.clone(),
            classes: Vec::new(),
            index: HashMap::new(),
            blank,
            max_classes: max_classes.max(1),
            min_samples: min_samples.max(1),
        }
    }

    /// Classes with a model of their own (used or still warming up).
    pub fn classes(&self) -> usize {
        self.classes.len()
    }

    fn model(&self, class: Option<u64>) -> Model<'_> {
        let Some(id) = class else {
            return Model::Group;
        };
        match self.index.get(&id) {
            Some(&i) if self.classes[i].samples() >= self.min_samples => {
                Model::Class(i, &self.classes[i])
            }
            Some(_) => Model::GroupForNow,
            None if self.classes.len() < self.max_classes => Model::GroupForNow,
            None => Model::Group,
        }
    }

    /// The class's model, made on its first finish while the table has room.
    fn class_mut(&mut self, id: u64) -> Option<(usize, &mut Hinted)> {
        let i = match self.index.get(&id) {
            Some(&i) => i,
            None if self.classes.len() < self.max_classes => {
                self.classes.push(self.blank.clone());
                self.index.insert(id, self.classes.len() - 1);
                self.classes.len() - 1
            }
            None => return None,
        };
        Some((i, &mut self.classes[i]))
    }
}

impl Predictor for Classed {
    fn name(&self) -> &'static str {
        "classed"
    }

    fn predict(&self, r: &RequestInfo, horizon: u32) -> Prediction {
        self.predict_with_reads(r, horizon).0
    }

    /// A request of a usable class reads its class's source alone (everything its class's
    /// model learned, whichever octave or ratio it read there); one predicted by the group's
    /// model reads what that read, or everything while its class may still become usable.
    fn predict_with_reads(&self, r: &RequestInfo, horizon: u32) -> (Prediction, Reads) {
        match self.model(r.class) {
            Model::Group => self.group.predict_with_reads(r, horizon),
            Model::GroupForNow => (self.group.predict(r, horizon), Reads::ALL),
            Model::Class(i, model) => (model.predict(r, horizon), Reads::one(class_source(i))),
        }
    }

    /// Requests predicted alike: as the group's model says for the requests it predicts, and
    /// within a class as its model says, told apart from every other class's and the group's
    /// by the class's table index in the key's top bits (Survival's keys use the low 40).
    fn alike(&self, r: &RequestInfo) -> Option<u64> {
        match self.model(r.class) {
            Model::Group => self.group.alike(r),
            Model::GroupForNow => None,
            Model::Class(i, model) => model.alike(r).map(|k| {
                debug_assert!(k < 1 << 40, "Survival's alike key fits 40 bits");
                (i as u64 + 1) << 40 | k
            }),
        }
    }

    fn observe(&mut self, f: &Finished) {
        let _ = self.learn(f);
    }

    /// What the group's model changed, and the class's source: sampled where everything its
    /// model changed was one sample of `f`'s length, replaced otherwise (a hint learned, an
    /// octave or the class made usable).
    fn learn(&mut self, f: &Finished) -> Changed {
        let changed = self.group.learn(f);
        let Some((i, model)) = f.class.and_then(|id| self.class_mut(id)) else {
            return changed;
        };
        let inner = model.learn(f);
        let source = class_source(i);
        let only_sampled = inner.sources().all(|s| !inner.replaces(s));
        match inner.sample_length() {
            Some(length) if only_sampled => changed.with_sample(source, length),
            _ => changed.with(source),
        }
    }

    fn stats(&self) -> PredictorStats {
        let mut s = self.group.stats();
        for c in &self.classes {
            let cs = c.stats();
            s.buckets += cs.buckets;
            s.bytes += cs.bytes;
        }
        s.classes = self.classes.len();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests as predict_tests;
    use super::*;

    const SHORT: u64 = 11;
    const LONG: u64 = 22;

    fn finished(output_tokens: u32, class: Option<u64>) -> Finished {
        Finished {
            class,
            ..predict_tests::fin(None, output_tokens)
        }
    }

    fn running(generated: u32, class: Option<u64>) -> RequestInfo {
        RequestInfo {
            class,
            ..predict_tests::running(generated, None, None)
        }
    }

    /// Two classes: SHORT outputs of 100..200 tokens, LONG ones of 1,000..2,000.
    fn taught(max_classes: usize) -> Classed {
        let mut c = PredictorConfig {
            max_classes,
            ..PredictorConfig::default()
        }
        .classed();
        for i in 0..400u32 {
            let _ = c.learn(&finished(100 + (i * 37) % 100, Some(SHORT)));
            let _ = c.learn(&finished(1_000 + (i * 37) % 1_000, Some(LONG)));
        }
        c
    }

    #[test]
    fn a_class_is_predicted_from_its_own_lengths() {
        let c = taught(DEFAULT_MAX_CLASSES);
        assert_eq!(c.classes(), 2);
        // at 150 tokens a SHORT request finishes within 60 more, surely; the group's
        // distribution (half of it 1,000 or more) is far less sure
        let short = c.predict(&running(150, Some(SHORT)), 60);
        assert!(short.p_finish > 0.99, "{short:?}");
        let group = c.predict(&running(150, None), 60);
        assert!(group.p_finish < 0.6, "{group:?}");
        // a LONG request at 150 runs on
        assert_eq!(c.predict(&running(150, Some(LONG)), 60).p_finish, 0.0);
    }

    #[test]
    fn unknown_and_overflowing_classes_are_predicted_as_the_group() {
        let c = taught(1);
        assert_eq!(c.classes(), 1, "the table holds one class");
        let (group, group_reads) = c.group.predict_with_reads(&running(150, None), 60);
        // LONG found the table full: predicted (and cached) exactly as a request without class
        assert_eq!(
            c.predict_with_reads(&running(150, Some(LONG)), 60),
            (group, group_reads)
        );
        assert_eq!(
            c.alike(&running(150, Some(LONG))),
            c.alike(&running(150, None))
        );
        // a class never seen, with room in the table, is predicted by the group for now, and
        // its prediction reads everything (its first finishes will move it to its own model)
        let c = taught(DEFAULT_MAX_CLASSES);
        let (p, reads) = c.predict_with_reads(&running(150, Some(33)), 60);
        assert_eq!(p, c.group.predict(&running(150, None), 60));
        assert_eq!(reads, Reads::ALL);
        assert_eq!(c.alike(&running(150, Some(33))), None);
    }

    #[test]
    fn without_classes_it_is_hinted_exactly() {
        let mut c = PredictorConfig::default().classed();
        let mut h = PredictorConfig::default().hinted();
        for i in 0..500u32 {
            let o = 50 + (i * 7_919) % 1_900;
            let f = Finished {
                expected_output: (i % 3 != 0).then_some(o),
                ..finished(o, None)
            };
            assert_eq!(c.learn(&f), h.learn(&f));
        }
        for j in [0, 100, 700, 1_500, 2_500] {
            for e in [None, Some(800), Some(1_900)] {
                let r = RequestInfo {
                    expected_output: e,
                    ..running(j, None)
                };
                assert_eq!(c.predict_with_reads(&r, 80), h.predict_with_reads(&r, 80));
                assert_eq!(c.alike(&r), h.alike(&r));
            }
        }
    }

    #[test]
    fn a_class_turns_usable_after_min_samples_and_says_so() {
        let mut c = PredictorConfig::default().classed();
        let min = PredictorConfig::default().min_samples;
        let r = running(150, Some(SHORT));
        for i in 0..min {
            assert_eq!(c.predict_with_reads(&r, 60).1, Reads::ALL, "after {i}");
            let _ = c.learn(&finished(120, Some(SHORT)));
        }
        let (p, reads) = c.predict_with_reads(&r, 60);
        assert_eq!(reads, Reads::one(class_source(0)));
        assert_eq!(p, Prediction::RUNS_ON, "every SHORT finish was at 120");
        assert!(c.predict(&running(100, Some(SHORT)), 60).p_finish > 0.99);
        // one more finish of the class is one sample of its source; a hinted one replaces it
        let changed = c.learn(&finished(130, Some(SHORT)));
        assert!(changed.contains(class_source(0)) && !changed.replaces(class_source(0)));
        assert_eq!(changed.sample_length(), Some(130));
        let hinted = Finished {
            expected_output: Some(130),
            ..finished(130, Some(SHORT))
        };
        assert!(c.learn(&hinted).replaces(class_source(0)));
        // a finish without class leaves the class's source alone
        assert!(!c.learn(&finished(130, None)).contains(class_source(0)));
    }

    #[test]
    fn alike_keys_of_classes_and_group_differ() {
        let c = taught(DEFAULT_MAX_CLASSES);
        let keys = [
            c.alike(&running(150, Some(SHORT))),
            c.alike(&running(150, Some(LONG))),
            c.alike(&running(150, None)),
        ];
        assert!(keys.iter().all(Option::is_some), "{keys:?}");
        assert_ne!(keys[0], keys[1]);
        assert_ne!(keys[0], keys[2]);
        assert_ne!(keys[1], keys[2]);
    }

    #[test]
    fn memory_is_bounded_by_max_classes() {
        let mut c = PredictorConfig {
            max_classes: 4,
            ..PredictorConfig::default()
        }
        .classed();
        for id in 0..1_000u64 {
            let _ = c.learn(&finished(100 + id as u32, Some(id)));
        }
        assert_eq!(c.classes(), 4);
        assert_eq!(c.stats().classes, 4);
        assert_eq!(c.stats().samples, 1_000);
    }
}
