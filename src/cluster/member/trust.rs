//! The member once Redis is not trusted ([`RedisStore::distrusted`]: its data lost or
//! replaced, docs/cluster.md "Trust Redis or refuse"): nothing more is written or owned, and
//! every report carries the reason as its error, so the bridge rejects new messages
//! `storage`, starts no turn and sends no result, and `/readyz` fails.

use super::{Member, Record, Report};

impl Member {
    /// The ownership pass's check (so that an idle instance notices too); true once Redis
    /// is not trusted (the pass then does nothing: no heartbeat, renewal or acquisition).
    pub(super) fn check_trust(&mut self, c: &mut Report) -> bool {
        if !self.distrusted
            && let Err(e) = self.store.check_generation_holds()
        {
            log::debug!("cluster generation check failed: {e}");
        }
        self.note_distrust(c);
        self.distrusted
    }

    /// A batch while Redis is not trusted: nothing is written; accepts fail (`reject
    /// storage`), the rest is dropped (it can never be written; every report carries an
    /// error, so the bridge releases nothing that waits for it: no turn starts, no result
    /// goes out).
    pub(super) fn refuse(&mut self, batch: Vec<Record>, c: &mut Report) {
        for r in batch {
            if let Record::Accepted(m) = r {
                c.failed.push(m.seq);
            }
        }
        self.note_distrust(c);
    }

    /// Once Redis is found to have lost its data: an ERROR, every partition held given up
    /// (their sessions end here without outcome records: nothing is answered from a
    /// database that forgot them), and from now on every report carries the reason.
    pub(super) fn note_distrust(&mut self, c: &mut Report) {
        let Some(why) = self.store.distrusted().map(str::to_owned) else {
            return;
        };
        if !self.distrusted {
            self.distrusted = true;
            log::error!("{why}");
            let held: Vec<u32> = self.own.held().map(|l| l.partition).collect();
            for p in &held {
                self.own.fenced(*p);
            }
            self.drop_kept_owned_writes(&held, c);
            c.cluster.lost.extend(held);
        }
        debug_assert!(
            self.own.held().next().is_none(),
            "nothing owned once distrusted"
        );
        self.retry.clear();
        c.retrying = 0;
        c.error = Some(why);
    }
}
