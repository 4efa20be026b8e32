//! Stop strings over a streamed text: the text is released as it comes except the tail that
//! could still begin a stop string, so a client never sees a stop string or part of one, and
//! the generation ends at the first stop string (vLLM's behaviour with stop strings excluded
//! from the output).

/// One request's stop strings and the text held back for them.
#[derive(Debug, Clone, Default)]
pub(super) struct StopText {
    stops: Vec<String>,
    /// Text not released yet.
    held: String,
    /// Bytes that must stay held: the longest stop string's length less one.
    hold: usize,
}

impl StopText {
    pub(super) fn new(stops: Vec<String>) -> Self {
        let hold = stops
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        Self {
            stops,
            held: String::new(),
            hold,
        }
    }

    /// Adds a token's text; returns the text to release now and whether a stop string ended
    /// the generation (the text is then everything before it; the rest is dropped). With
    /// `check` false (before `min_tokens`) no stop string is matched yet.
    pub(super) fn push(&mut self, text: &str, check: bool) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.held.push_str(text);
        if check
            && let Some(at) = self
                .stops
                .iter()
                .filter_map(|s| self.held.find(s.as_str()))
                .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let mut cut = self.held.len().saturating_sub(self.hold);
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        (self.held.drain(..cut).collect(), false)
    }

    /// The text still held, for the last token of a generation that ended otherwise.
    pub(super) fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams `chunks`; returns the released text, and the chunk index a stop string ended at.
    fn stream(stops: &[&str], chunks: &[&str]) -> (String, Option<usize>) {
        let mut s = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for (i, c) in chunks.iter().enumerate() {
            let (t, stop) = s.push(c, true);
            out += &t;
            if stop {
                return (out, Some(i));
            }
        }
        out += &s.flush();
        (out, None)
    }

    #[test]
    fn a_stop_string_across_tokens_ends_the_text_before_it() {
        assert_eq!(
            stream(
                &["\n\nUser"],
                &["Hello", " there", "\n", "\nUs", "er:", " more"]
            ),
            ("Hello there".into(), Some(4))
        );
        // The earliest of several wins; text before it in the same token is kept.
        assert_eq!(
            stream(&["cd", "bcx", "z"], &["ab", "cdz"]),
            ("ab".into(), Some(1))
        );
        // A prefix that does not complete is released in the end.
        assert_eq!(
            stream(&["stop"], &["a st", "o", "p!"]),
            ("a ".into(), Some(2))
        );
        assert_eq!(stream(&["stop"], &["a st", "o"]), ("a sto".into(), None));
        assert_eq!(stream(&[], &["a", "b"]), ("ab".into(), None));
    }

    #[test]
    fn held_text_is_released_on_character_boundaries_and_nothing_is_lost() {
        let chunks = ["é", "日本", "x", "語é", "yz"];
        let mut s = StopText::new(vec!["none here".into()]);
        let (mut out, mut pushed) = (String::new(), 0);
        for c in chunks {
            let (t, stop) = s.push(c, true);
            assert!(!stop);
            out += &t;
            pushed += c.len();
            // At most the last `hold` bytes (8), widened to a character boundary, are held.
            assert!(pushed - out.len() <= 8 + 3, "{pushed} {}", out.len());
        }
        out += &s.flush();
        assert_eq!(out, chunks.concat());
    }

    #[test]
    fn before_min_tokens_stop_strings_are_not_matched() {
        let mut s = StopText::new(vec!["ab".into()]);
        let (t, stop) = s.push("xab", false);
        assert!(!stop);
        assert_eq!(t, "xa");
        // Once checked, a stop string in the held text counts.
        let (t, stop) = s.push("ab", true);
        assert!(stop);
        assert_eq!(t, "b");
    }
}
