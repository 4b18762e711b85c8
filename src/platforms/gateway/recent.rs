//! [`RecentIds`]: the bounded memory of result ids already handled, kept on disk too when
//! the bridge has a `--state-dir` (so a restarted bridge does not show a result twice).

use std::collections::{HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Longest id kept on disk (longer ones, which no gateway sends, are remembered in memory only).
const MAX_STORED_ID_BYTES: usize = 1024;

/// A bounded set of ids, oldest forgotten first.
#[derive(Debug)]
pub(crate) struct RecentIds {
    order: VecDeque<String>,
    set: HashSet<String>,
    capacity: usize,
    file: Option<IdFile>,
}

/// The ids on disk: one a line, appended as they come; rewritten with only the remembered
/// ones once it holds twice as many, so it never passes `2 × capacity` lines.
#[derive(Debug)]
struct IdFile {
    path: PathBuf,
    file: File,
    lines: usize,
}

impl RecentIds {
    /// Remembers at most `capacity` ids (at least one).
    pub(crate) fn new(capacity: usize) -> RecentIds {
        RecentIds {
            order: VecDeque::new(),
            set: HashSet::new(),
            capacity: capacity.max(1),
            file: None,
        }
    }

    /// Remembers at most `capacity` ids, in `path` too: the newest `capacity` ids it holds
    /// are remembered from the start (its directory is created if need be).
    pub(crate) fn open(path: &Path, capacity: usize) -> Result<RecentIds, String> {
        let what = |e: std::io::Error| format!("{}: {e}", path.display());
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(what)?;
        }
        let mut ids = RecentIds::new(capacity);
        let mut lines = 0;
        match std::fs::read(path) {
            Ok(bytes) => {
                for id in String::from_utf8_lossy(&bytes).lines() {
                    lines += 1;
                    if !id.is_empty() {
                        ids.insert(id);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(what(e)),
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(what)?;
        ids.file = Some(IdFile {
            path: path.to_owned(),
            file,
            lines,
        });
        Ok(ids)
    }

    /// Remembers `id` (on disk too, before it returns); returns false if it was already there.
    pub(crate) fn insert(&mut self, id: &str) -> bool {
        if self.set.contains(id) {
            return false;
        }
        if self.order.len() == self.capacity
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        self.order.push_back(id.to_owned());
        self.set.insert(id.to_owned());
        debug_assert!(self.order.len() <= self.capacity && self.set.len() == self.order.len());
        if let Some(f) = &mut self.file
            && id.len() <= MAX_STORED_ID_BYTES
            && !id.contains(['\n', '\r'])
        {
            if let Err(e) = f.file.write_all(format!("{id}\n").as_bytes()) {
                error_limited!(
                    "gateway: {}: {e}; a result shown now may be shown again after a restart",
                    f.path.display()
                );
            }
            f.lines += 1;
            if f.lines > 2 * self.capacity {
                self.rewrite();
            }
        }
        true
    }

    /// Rewrites the file with only the ids remembered (through a new file and a rename, so
    /// a crash leaves one or the other whole).
    fn rewrite(&mut self) {
        let Some(f) = &mut self.file else {
            return;
        };
        let tmp = f.path.with_extension("new");
        let mut text = String::new();
        for id in &self.order {
            if id.len() <= MAX_STORED_ID_BYTES && !id.contains(['\n', '\r']) {
                text.push_str(id);
                text.push('\n');
            }
        }
        let done = std::fs::write(&tmp, &text)
            .and_then(|()| std::fs::rename(&tmp, &f.path))
            .and_then(|()| OpenOptions::new().append(true).open(&f.path));
        match done {
            Ok(file) => {
                f.file = file;
                f.lines = self.order.len();
            }
            Err(e) => error_limited!("gateway: rewriting {}: {e}", f.path.display()),
        }
    }

    /// Whether `id` is remembered.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.set.contains(id)
    }

    /// Ids remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_survive_a_reopen_and_the_file_stays_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state").join("x-shown");
        let mut ids = RecentIds::open(&path, 3).expect("open");
        for i in 0..20 {
            assert!(ids.insert(&format!("id-{i}")));
        }
        assert!(!ids.insert("id-19"));
        let lines = std::fs::read_to_string(&path)
            .expect("file")
            .lines()
            .count();
        assert!(lines <= 6, "{lines} lines for a capacity of 3");
        drop(ids);
        let ids = RecentIds::open(&path, 3).expect("reopen");
        assert_eq!(ids.len(), 3);
        assert!(ids.contains("id-19") && ids.contains("id-17") && !ids.contains("id-16"));
        let mut fresh = RecentIds::new(3);
        assert!(fresh.insert("id-19"), "in memory only, nothing is read");
    }
}
