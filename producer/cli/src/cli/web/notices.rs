//! What an action tells the page it redirects to ("Paused queue default: …").
//!
//! The text never travels in the URL: a link anyone can craft (`/?msg=Your session expired,
//! call …`) would otherwise render as a trusted notice. The action stores the text here and
//! redirects with its random id; an unknown or expired id shows nothing.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Notices kept at most (the oldest go first).
const KEPT: usize = 256;
/// How long a notice can be shown (a reload within it shows it again).
const SHOWN_FOR: Duration = Duration::from_secs(600);

/// The notices of this process.
#[derive(Debug, Default)]
pub struct Notices {
    inner: Mutex<VecDeque<(String, Instant, String)>>,
}

impl Notices {
    /// Stores `text`; returns the id a redirect carries.
    pub fn post(&self, text: String) -> String {
        let id = uuid::Uuid::new_v4().simple().to_string();
        if let Ok(mut q) = self.inner.lock() {
            while q.len() >= KEPT {
                q.pop_front();
            }
            q.push_back((id.clone(), Instant::now(), text));
        }
        id
    }

    /// The text stored under `id`, if it is still there.
    pub fn get(&self, id: &str) -> Option<String> {
        let q = self.inner.lock().ok()?;
        q.iter().find(|(i, at, _)| i == id && at.elapsed() < SHOWN_FOR).map(|(_, _, t)| t.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_posted_notices_are_shown() {
        let n = Notices::default();
        let id = n.post("Paused queue default.".into());
        assert_eq!(n.get(&id).as_deref(), Some("Paused queue default."));
        assert_eq!(n.get("Your session expired"), None);
        for i in 0..KEPT {
            n.post(format!("{i}"));
        }
        assert_eq!(n.get(&id), None, "the oldest went first");
    }
}
