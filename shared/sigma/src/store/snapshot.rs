//! σ to and from a full `ClusterSnapshot`, validated on the way in.

use super::*;

impl Sigma {
    /// Builds σ from a full snapshot, validating it: a non-empty group, a non-zero epoch,
    /// workers with distinct ids (at most [`MAX_WORKER_ID`]), non-zero incarnations and
    /// capacities; requests with valid distinct ids on a known, non-fenced worker of the same
    /// incarnation, RESERVED ones with no generated tokens. `load_tokens` is recomputed.
    pub fn from_snapshot(snap: &v1::ClusterSnapshot) -> Result<Sigma, SigmaError> {
        if snap.group.is_empty() || snap.group.len() > limits::MAX_GROUP_BYTES {
            return Err(SigmaError::Invalid(format!(
                "group must be 1..={} bytes",
                limits::MAX_GROUP_BYTES
            )));
        }
        if snap.epoch == 0 {
            return Err(SigmaError::Invalid("snapshot epoch must not be 0".into()));
        }
        let mut s = Sigma::with_epoch(snap.group.clone(), snap.epoch);
        s.version = snap.version;
        for w in &snap.workers {
            if s.workers.contains_key(&w.worker_id) {
                return Err(SigmaError::Invalid(format!(
                    "worker {} listed twice",
                    w.worker_id
                )));
            }
            s.worker_up(
                w.worker_id,
                w.incarnation,
                w.capacity,
                &w.endpoint,
                &w.carrier,
            )?;
        }
        for r in &snap.requests {
            let id = request_id(&r.request_id)?;
            let phase = match v1::RequestPhase::try_from(r.state) {
                Ok(v1::RequestPhase::Reserved) => Phase::Queued,
                Ok(v1::RequestPhase::Active) => Phase::Running,
                _ => {
                    return Err(SigmaError::Invalid(format!(
                        "request {:?} has no valid state",
                        r.request_id
                    )));
                }
            };
            if phase == Phase::Queued && r.generated_tokens != 0 {
                return Err(SigmaError::Invalid(format!(
                    "reserved request {:?} has generated tokens",
                    r.request_id
                )));
            }
            check_tokens(r.prompt_tokens, r.generated_tokens)?;
            if s.requests.contains_key(&crate::id_key::ById(id.as_str())) {
                return Err(SigmaError::DuplicateRequest(r.request_id.clone()));
            }
            s.check_worker(r.worker_id, r.incarnation)?;
            let fenced = snap.workers.iter().any(|w| {
                w.worker_id == r.worker_id && Liveness::from_wire(w.liveness) == Liveness::Fenced
            });
            if fenced {
                return Err(SigmaError::WorkerFenced(r.worker_id));
            }
            s.insert(Request {
                id,
                key: 0,
                worker: r.worker_id,
                incarnation: r.incarnation,
                prompt_tokens: r.prompt_tokens,
                generated_tokens: r.generated_tokens,
                phase,
                prompt_hash: r.prompt_hash,
                max_tokens: r.max_tokens,
                hints: Hints {
                    expected_output: r.expected_output_tokens,
                    class: r.request_class_id,
                },
                slot: SlotHint::default(),
            })?;
        }
        for w in &snap.workers {
            match Liveness::from_wire(w.liveness) {
                Liveness::Live => {}
                Liveness::Suspect => {
                    s.worker_suspect(w.worker_id, w.incarnation)?;
                }
                Liveness::Fenced => {
                    s.worker_fenced(w.worker_id, w.incarnation)?;
                }
            }
            if w.cordoned {
                s.worker_cordon(w.worker_id, true)?;
            }
        }
        Ok(s)
    }

    /// The full σ, deterministic: workers sorted by id, requests by request id.
    pub fn to_snapshot(&self) -> v1::ClusterSnapshot {
        let workers = self
            .workers
            .values()
            .map(|w| v1::WorkerState {
                worker_id: w.id,
                incarnation: w.incarnation,
                capacity: w.capacity,
                endpoint: w.endpoint.clone(),
                liveness: w.liveness.to_wire() as i32,
                load_tokens: self.cluster.worker(w.id).map_or(0, |c| c.load()),
                carrier: w.carrier.clone(),
                cordoned: w.cordoned,
            })
            .collect();
        let mut reqs: Vec<&Request> = self.requests.values().collect();
        reqs.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        let requests = reqs
            .into_iter()
            .map(|r| v1::RequestState {
                request_id: r.id.to_string(),
                worker_id: r.worker,
                incarnation: r.incarnation,
                prompt_tokens: r.prompt_tokens,
                generated_tokens: r.generated_tokens,
                state: match r.phase {
                    Phase::Queued => v1::RequestPhase::Reserved,
                    Phase::Running => v1::RequestPhase::Active,
                } as i32,
                prompt_hash: r.prompt_hash,
                max_tokens: r.max_tokens,
                expected_output_tokens: r.hints.expected_output,
                request_class_id: r.hints.class,
            })
            .collect();
        v1::ClusterSnapshot {
            group: self.group.clone(),
            epoch: self.epoch,
            version: self.version,
            workers,
            requests,
        }
    }
}
