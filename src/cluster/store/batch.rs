//! The journal's batch as Redis runs it: the operations of one partition in one call of the
//! batch script (`scripts.rs`, [`batch_source`](super::scripts::batch_source)), each answered
//! on its own.

use std::collections::BTreeMap;

use redis::{ToRedisArgs, Value};

use super::{
    Accept, Done, Keys, Op, PRUNE_EVERY, PRUNE_PER_ACCEPT, RedisStore, STREAM_MAXLEN, dedup_member,
    ids_key, leases, malformed, strings,
};
use crate::journal::StoreError;

/// One operation of a batch as the batch script reads it: its body (`a` accept, `s` started,
/// `o` outcome, `f` finish), its keys and its arguments, as that body's KEYS and ARGV.
pub(super) struct OpCall {
    kind: &'static str,
    keys: Vec<String>,
    args: Vec<Vec<u8>>,
}

impl OpCall {
    pub(super) fn new(kind: &'static str, keys: Vec<String>) -> OpCall {
        OpCall {
            kind,
            keys,
            args: Vec::new(),
        }
    }

    /// Adds an argument, as [`redis::Cmd::arg`] would.
    pub(super) fn arg(&mut self, v: impl ToRedisArgs) -> &mut OpCall {
        self.args.extend(v.to_redis_args());
        self
    }
}

/// The partition whose keys an operation writes (an accept also writes the `ids` index of
/// its id's partition).
fn partition(op: &Op<'_>) -> u32 {
    match op {
        Op::Accept { partition, .. }
        | Op::Delivered { partition, .. }
        | Op::Forget { partition, .. } => *partition,
        Op::Started { lease, .. } | Op::Outcome { lease, .. } => lease.partition,
    }
}

impl RedisStore {
    /// The journal thread's group commit: every operation of `ops` in one round trip (one
    /// pipeline of one batch-script call per partition, each atomic; Redis syncs what one
    /// pass of its event loop wrote with one fsync). A partition's operations run in their
    /// order in `ops`; those of two partitions are independent. One answer per operation, in
    /// order: an owned write of a lost lease is [`Fenced`](crate::journal::StoreErrorKind::Fenced)
    /// and changed nothing, while the others went through. `Err` for the whole batch if
    /// Redis could not be asked or did not answer: then any of them may or may not have
    /// been applied, and only idempotent ones (all but accepts) may be sent again.
    pub fn write(
        &mut self,
        ops: &[Op<'_>],
        now_ms: u64,
    ) -> Result<Vec<Result<Done, StoreError>>, StoreError> {
        let calls: Vec<OpCall> = ops.iter().map(|op| self.op_call(op, now_ms)).collect();
        let mut by_partition: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, op) in ops.iter().enumerate() {
            by_partition.entry(partition(op)).or_default().push(i);
        }
        let groups: Vec<Vec<usize>> = by_partition.into_values().collect();
        let replies = self.pipelined("write", groups.len(), |s, pipe| {
            for g in &groups {
                pipe.add_command(s.batch_cmd(g.iter().map(|&i| &calls[i])));
            }
        })?;
        // Each answer on its own: one fenced or failed operation must not hide the others'.
        let mut answers = vec![Value::Nil; ops.len()];
        for (g, reply) in groups.iter().zip(replies) {
            match reply {
                Value::Array(each) if each.len() == g.len() => {
                    for (&i, v) in g.iter().zip(each) {
                        answers[i] = v;
                    }
                }
                // Refused as a whole (NOSCRIPT, OOM, a read-only replica): nothing applied.
                Value::ServerError(_) => {
                    for &i in g {
                        answers[i] = reply.clone();
                    }
                }
                _ => return Err(malformed("write")),
            }
        }
        for (op, v) in ops.iter().zip(&answers) {
            match op {
                Op::Accept { partition, .. } => self.note_accept_answer(*partition, v),
                Op::Outcome { lease, .. } => self.note_outcome_answer(lease.partition, v),
                _ => {}
            }
        }
        self.wait_replicas()?;
        Ok(ops
            .iter()
            .zip(&answers)
            .map(|(op, v)| self.op_answer(op, v))
            .collect())
    }

    /// One `EVALSHA` of the batch script for `calls` (the scripts are loaded on every new
    /// connection).
    fn batch_cmd<'c>(&self, calls: impl Iterator<Item = &'c OpCall> + Clone) -> redis::Cmd {
        let mut c = redis::cmd("EVALSHA");
        let keys: usize = calls.clone().map(|o| o.keys.len()).sum();
        c.arg(self.scripts.batch.get_hash()).arg(keys);
        for o in calls.clone() {
            c.arg(&o.keys);
        }
        c.arg(calls.clone().count());
        for o in calls.clone() {
            c.arg(o.kind).arg(o.keys.len()).arg(o.args.len());
        }
        for o in calls {
            for a in &o.args {
                c.arg(a.as_slice());
            }
        }
        c
    }

    /// One operation as the batch script reads it.
    fn op_call(&self, op: &Op<'_>, now_ms: u64) -> OpCall {
        match *op {
            Op::Accept {
                partition,
                session,
                message: m,
                session_cap,
            } => {
                debug_assert!(partition < self.cfg.partitions);
                let keys = Keys::of(partition);
                let member = dedup_member(m.platform(), m.id());
                let mut names: Vec<String> = ["seq", "q", "dedupx", "sessions", "in", "gen"]
                    .map(|k| keys.k(k))
                    .into();
                names.push(ids_key(&member, self.cfg.partitions));
                let mut c = OpCall::new("a", names);
                c.arg(keys.k("m:"))
                    .arg(&member)
                    .arg(now_ms)
                    .arg(m.dedup_until_ms)
                    .arg(session)
                    .arg(session_cap)
                    .arg(STREAM_MAXLEN)
                    .arg(PRUNE_PER_ACCEPT)
                    .arg(&self.cfg.instance)
                    .arg(&self.generation)
                    .arg(self.marks.get(&partition).copied().unwrap_or(0))
                    .arg(PRUNE_EVERY);
                let f = &m.fields;
                // Absent when none: a message without files is stored as it always was.
                let attachments = (!f.attachments.is_empty())
                    .then(|| crate::attachments::to_json(&f.attachments));
                for (k, v) in [
                    ("p", Some(m.platform())),
                    ("i", Some(f.id.as_str())),
                    ("ct", Some(f.chat_type.as_str())),
                    ("c", Some(f.chat_id.as_str())),
                    ("tx", Some(f.text.as_str())),
                    ("th", f.thread_id.as_deref()),
                    ("u", f.user_id.as_deref()),
                    ("un", f.user_name.as_deref()),
                    ("meta", f.meta.as_deref()),
                    ("att", attachments.as_deref()),
                ] {
                    if let Some(v) = v {
                        c.arg(k).arg(v);
                    }
                }
                c
            }
            Op::Started {
                lease,
                seq,
                attempt,
            } => {
                let keys = Keys::of(lease.partition);
                let mut c = OpCall::new("s", vec![keys.k("lease")]);
                c.arg(&lease.token).arg(keys.message(seq)).arg(attempt);
                c
            }
            Op::Outcome {
                lease,
                seq,
                outcome,
            } => self.outcome_call(lease, seq, outcome),
            Op::Delivered { partition, seq } | Op::Forget { partition, seq } => {
                let keys = Keys::of(partition);
                let names = ["q", "dedupx", "sessions"].map(|k| keys.k(k));
                let forget = matches!(op, Op::Forget { .. });
                let mut c = OpCall::new("f", names.into());
                c.arg(keys.message(seq))
                    .arg(seq)
                    .arg(now_ms)
                    .arg(if forget { "1" } else { "0" });
                c
            }
        }
    }

    fn op_answer(&self, op: &Op<'_>, v: &Value) -> Result<Done, StoreError> {
        leases::refused(v, "write")?;
        let a = strings(v);
        if a.first().map(String::as_str) == Some("error") {
            // An operation's own error (a key of another type): as a refused script.
            let why = a.get(1).map_or("an error", String::as_str);
            return Err(StoreError::transient(format!("redis: write: {why}")));
        }
        match op {
            Op::Accept { .. } => {
                let a = strings(v);
                match a.first().map(String::as_str) {
                    Some("new") => {
                        let seq = a.get(1).and_then(|s| s.parse().ok());
                        let ahead = a.get(2).and_then(|s| s.parse().ok());
                        seq.zip(ahead)
                            .map(|(seq, ahead)| Done::Accepted(Accept::New { seq, ahead }))
                            .ok_or_else(|| malformed("accept"))
                    }
                    Some("duplicate") => Ok(Done::Accepted(Accept::Duplicate)),
                    Some("full") => Ok(Done::Accepted(Accept::SessionFull)),
                    Some("generation" | "older") => {
                        Err(StoreError::untrusted(self.distrust.clone().unwrap_or_else(
                            || "redis: accept: another generation or an older copy".into(),
                        )))
                    }
                    _ => Err(malformed("accept")),
                }
            }
            Op::Started { lease, .. } => self.owned_verdict(v, lease, "started").map(Done::Written),
            Op::Outcome { lease, .. } => self.owned_verdict(v, lease, "outcome").map(Done::Written),
            Op::Delivered { .. } | Op::Forget { .. } => {
                match strings(v).first().map(String::as_str) {
                    Some("ok") => Ok(Done::Written(true)),
                    Some("gone") => Ok(Done::Written(false)),
                    _ => Err(malformed("delivered")),
                }
            }
        }
    }
}
