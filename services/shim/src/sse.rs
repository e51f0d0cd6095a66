//! Reading (and, where the shim asked for more than the client did, trimming) the
//! server-sent events of an OpenAI-compatible streaming response, without re-serialising
//! anything: bytes the shim does not need to change reach the client exactly as the engine
//! wrote them.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;

/// Splits a byte stream into complete SSE events (each ending with a blank line).
#[derive(Debug, Default)]
pub struct EventSplitter {
    buf: BytesMut,
}

impl EventSplitter {
    /// Appends `data` and returns every event completed by it, each with its terminator.
    pub fn push(&mut self, data: &[u8]) -> Vec<Bytes> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        while let Some(end) = event_end(&self.buf) {
            out.push(self.buf.split_to(end).freeze());
        }
        out
    }

    /// Whatever is left that did not end with a blank line.
    pub fn rest(&mut self) -> Bytes {
        self.buf.split().freeze()
    }
}

/// The end (exclusive) of the first complete event: after `\n\n`, `\r\n\r\n` or `\r\r`.
fn event_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < buf.len() {
        match buf[i] {
            b'\n' => {
                if buf.get(i + 1) == Some(&b'\n') {
                    return Some(i + 2);
                }
                if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                    return Some(i + 3);
                }
            }
            b'\r' if buf.get(i + 1) == Some(&b'\r') => return Some(i + 2),
            _ => {}
        }
        i += 1;
    }
    None
}

/// The `data:` payload of an event (several data lines joined by `\n`), if it has any.
pub fn event_data(event: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            match &mut data {
                Some(d) => {
                    d.push(b'\n');
                    d.extend_from_slice(rest);
                }
                None => data = Some(rest.to_vec()),
            }
        }
    }
    data
}

/// What the shim reads from one chunk.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChunkInfo {
    pub id: Option<String>,
    /// Number of choices in the chunk (0 for the final usage-only chunk).
    pub choices: usize,
    /// Whether a choice of the chunk has a `finish_reason` (its terminal chunk).
    pub finishing: bool,
    pub usage: Option<UsageInfo>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct UsageInfo {
    #[serde(default)]
    pub prompt_tokens: u32,
    #[serde(default)]
    pub completion_tokens: u32,
}

#[derive(Deserialize)]
struct Peek {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    choices: Option<Vec<PeekChoice>>,
    #[serde(default)]
    usage: Option<UsageInfo>,
}

#[derive(Deserialize)]
struct PeekChoice {
    #[serde(default)]
    finish_reason: Option<serde::de::IgnoredAny>,
}

/// Reads the fields the shim needs from a chunk's JSON; `None` if it is not a JSON object
/// (e.g. `[DONE]`).
pub fn peek(json: &[u8]) -> Option<ChunkInfo> {
    let p: Peek = serde_json::from_slice(json).ok()?;
    let choices = p.choices.unwrap_or_default();
    Some(ChunkInfo {
        id: p.id,
        finishing: choices.iter().any(|c| c.finish_reason.is_some()),
        choices: choices.len(),
        usage: p.usage,
    })
}

/// The raw text of the top-level member `key`'s value in a JSON object. `None` if the text is
/// not an object or has no such member.
pub fn member<'a>(json: &'a [u8], key: &str) -> Option<&'a [u8]> {
    let mut s = Scanner { b: json, i: 0 };
    s.ws();
    s.expect(b'{')?;
    loop {
        s.ws();
        if s.peek()? == b'}' {
            return None;
        }
        let k = s.string()?;
        s.ws();
        s.expect(b':')?;
        s.ws();
        let start = s.i;
        s.value()?;
        if k == key.as_bytes() {
            return Some(&json[start..s.i]);
        }
        s.ws();
        match s.peek()? {
            b',' => s.i += 1,
            _ => return None,
        }
    }
}

/// A JSON object with `"key":value` added as its last member (`value` raw JSON text), every
/// other byte as it was. `None` if the text does not end an object.
pub fn append_member(json: &[u8], key: &str, value: &[u8]) -> Option<Vec<u8>> {
    let close = json.iter().rposition(|c| !c.is_ascii_whitespace())?;
    if json[close] != b'}' {
        return None;
    }
    let inner = json[..close]
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())?;
    let empty = json[inner] == b'{';
    let mut out = Vec::with_capacity(json.len() + key.len() + value.len() + 4);
    out.extend_from_slice(&json[..close]);
    if !empty {
        out.push(b',');
    }
    out.push(b'"');
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(value);
    out.extend_from_slice(&json[close..]);
    Some(out)
}

/// Removes the top-level member `key` from a JSON object, keeping every other byte as it
/// was. `None` if the text is not an object or has no such member.
pub fn remove_member(json: &[u8], key: &str) -> Option<Vec<u8>> {
    let mut s = Scanner { b: json, i: 0 };
    s.ws();
    s.expect(b'{')?;
    // End of the previous member's value (where its trailing comma starts), if any.
    let mut prev_end: Option<usize> = None;
    loop {
        s.ws();
        if s.peek()? == b'}' {
            return None;
        }
        let member_start = s.i;
        let k = s.string()?;
        s.ws();
        s.expect(b':')?;
        s.ws();
        s.value()?;
        let value_end = s.i;
        s.ws();
        let sep = s.peek()?;
        if k == key.as_bytes() {
            let (from, to) = match prev_end {
                // `,"key":value` (drop from the previous comma)
                Some(p) => (p, value_end),
                // first member: `"key":value,` (drop through the comma and spaces after it)
                None if sep == b',' => {
                    let mut t = s.i + 1;
                    while t < json.len() && json[t].is_ascii_whitespace() {
                        t += 1;
                    }
                    (member_start, t)
                }
                // the only member
                None => (member_start, value_end),
            };
            let mut out = Vec::with_capacity(json.len());
            out.extend_from_slice(&json[..from]);
            out.extend_from_slice(&json[to..]);
            return Some(out);
        }
        match sep {
            b',' => {
                prev_end = Some(value_end);
                s.i += 1;
            }
            b'}' => return None,
            _ => return None,
        }
    }
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    fn ws(&mut self) {
        while self.i < self.b.len() && self.b[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }
    fn expect(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }
    /// A string; returns its raw (still escaped) content.
    fn string(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        let start = self.i;
        loop {
            match self.peek()? {
                b'\\' => self.i += 2,
                b'"' => {
                    let b: &'a [u8] = self.b;
                    let s = &b[start..self.i];
                    self.i += 1;
                    return Some(s);
                }
                _ => self.i += 1,
            }
        }
    }
    fn value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.peek()? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
            }
            _ => {
                while let Some(c) = self.peek() {
                    if c == b',' || c == b'}' || c == b']' || c.is_ascii_whitespace() {
                        break;
                    }
                    self.i += 1;
                }
                Some(())
            }
        }
    }
}

/// Replaces the data of an event by `data` (single-line JSON), keeping the event's other
/// lines and its terminator.
pub fn replace_data(event: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.len());
    let mut replaced = false;
    let mut rest = event;
    while !rest.is_empty() {
        let (line, tail) = match rest.iter().position(|&b| b == b'\n') {
            Some(p) => (&rest[..=p], &rest[p + 1..]),
            None => (rest, &rest[rest.len()..]),
        };
        rest = tail;
        if line.starts_with(b"data:") {
            if !replaced {
                let sp = if line.starts_with(b"data: ") { 6 } else { 5 };
                out.extend_from_slice(&line[..sp]);
                out.extend_from_slice(data);
                let eol_start = line
                    .iter()
                    .rposition(|&b| b != b'\n' && b != b'\r')
                    .map_or(line.len(), |p| p + 1);
                out.extend_from_slice(&line[eol_start..]);
                replaced = true;
            }
        } else {
            out.extend_from_slice(line);
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn splits_events_across_reads() {
        let mut s = EventSplitter::default();
        assert!(s.push(b"data: {\"a\":1}\n").is_empty());
        let ev = s.push(b"\ndata: [DO");
        assert_eq!(ev, vec![Bytes::from_static(b"data: {\"a\":1}\n\n")]);
        let ev = s.push(b"NE]\r\n\r\n");
        assert_eq!(ev, vec![Bytes::from_static(b"data: [DONE]\r\n\r\n")]);
        assert!(s.rest().is_empty());
    }

    #[test]
    fn removes_members_byte_exactly() {
        let j = br#"{"id":"x","choices":[{"a":"}\"{,"}],"usage":{"prompt_tokens":3}}"#;
        assert_eq!(
            remove_member(j, "usage").unwrap(),
            br#"{"id":"x","choices":[{"a":"}\"{,"}]}"#
        );
        assert_eq!(
            remove_member(br#"{"usage":null, "id":"x"}"#, "usage").unwrap(),
            br#"{"id":"x"}"#
        );
        assert_eq!(
            remove_member(br#"{ "usage" : 1 }"#, "usage").unwrap(),
            br#"{  }"#
        );
        assert_eq!(
            remove_member(br#"{"id":"x","usage":{"a":[1,2]},"z":true}"#, "usage").unwrap(),
            br#"{"id":"x","z":true}"#
        );
        assert!(remove_member(br#"{"id":"usage"}"#, "usage").is_none());
        assert!(remove_member(b"[DONE]", "usage").is_none());
        assert!(remove_member(br#"{"id":"#, "usage").is_none());
    }

    #[test]
    fn reads_usage_and_choices() {
        let c = peek(br#"{"id":"c1","choices":[{}],"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2}}"#).unwrap();
        assert_eq!(c.id.as_deref(), Some("c1"));
        assert_eq!(c.choices, 1);
        assert_eq!(
            c.usage,
            Some(UsageInfo {
                prompt_tokens: 5,
                completion_tokens: 2
            })
        );
        assert!(!c.finishing);
        assert!(peek(b"[DONE]").is_none());
        assert_eq!(peek(br#"{"choices":[],"usage":null}"#).unwrap().usage, None);
        let two = br#"{"choices":[{"finish_reason":null},{"finish_reason":"length"}]}"#;
        assert!(peek(two).unwrap().finishing);
        assert!(
            !peek(br#"{"choices":[{"finish_reason":null}]}"#)
                .unwrap()
                .finishing
        );
    }

    #[test]
    fn reads_and_appends_members_byte_exactly() {
        let j = br#"{"id":"x","choices":[{"t":"}\"{,"}],"system_fingerprint":"fp-1" }"#;
        assert_eq!(member(j, "system_fingerprint").unwrap(), br#""fp-1""#);
        assert_eq!(member(j, "choices").unwrap(), br#"[{"t":"}\"{,"}]"#);
        assert!(member(j, "usage").is_none());
        assert!(member(br#"{"id":"system_fingerprint"}"#, "system_fingerprint").is_none());
        assert!(member(b"[DONE]", "id").is_none());
        assert_eq!(
            append_member(
                br#"{"id":"x","choices":[]}"#,
                "system_fingerprint",
                br#""fp""#
            )
            .unwrap(),
            br#"{"id":"x","choices":[],"system_fingerprint":"fp"}"#
        );
        assert_eq!(append_member(b"{ }\n", "a", b"1").unwrap(), b"{ \"a\":1}\n");
        assert!(append_member(b"[1]", "a", b"1").is_none());
    }

    #[test]
    fn replaces_data_keeping_framing() {
        assert_eq!(
            replace_data(b"data: {\"a\":1}\r\n\r\n", b"{}"),
            b"data: {}\r\n\r\n"
        );
        assert_eq!(
            replace_data(b"event: x\ndata:{\"a\":1}\n\n", b"{}"),
            b"event: x\ndata:{}\n\n"
        );
        assert_eq!(event_data(b"data: a\ndata: b\n\n").unwrap(), b"a\nb");
    }
}
