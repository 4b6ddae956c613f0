//! Incremental server-sent-events parsing over arbitrary byte splits (an event, a line or a
//! UTF-8 character may arrive across several reads).
//!
//! Lines end in `\n` or `\r\n` (servers never use a lone `\r`); an event ends at a blank line
//! or at the end of the stream. `data: [DONE]` is OpenAI's end-of-stream marker.

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseEvent {
    /// An event with data (its `data:` lines joined by `\n`) and its `event:` name, if any.
    Message {
        /// The `event:` field.
        event: Option<String>,
        /// The joined `data:` lines.
        data: String,
    },
    /// `data: [DONE]`.
    Done,
}

/// Parser state between reads.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Vec<String>,
    event: Option<String>,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one read; returns the events it completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + nl;
            let line = self.buf[start..end].strip_suffix(b"\r").unwrap_or(&self.buf[start..end]);
            let line = String::from_utf8_lossy(line).into_owned();
            start = end + 1;
            if let Some(ev) = self.line(&line) {
                out.push(ev);
            }
        }
        self.buf.drain(..start);
        out
    }

    /// Ends the stream: a last event without its blank line is still dispatched.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let rest = std::mem::take(&mut self.buf);
        if !rest.is_empty() {
            let rest = String::from_utf8_lossy(rest.strip_suffix(b"\r").unwrap_or(&rest)).into_owned();
            if let Some(ev) = self.line(&rest) {
                return Some(ev);
            }
        }
        self.dispatch()
    }

    fn line(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            return self.dispatch();
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => self.data.push(value.to_string()),
            "event" => self.event = Some(value.to_string()),
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let event = self.event.take();
        if self.data.is_empty() {
            return None;
        }
        let data = std::mem::take(&mut self.data).join("\n");
        if data.trim() == "[DONE]" {
            Some(SseEvent::Done)
        } else {
            Some(SseEvent::Message { event, data })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(data: &str) -> SseEvent {
        SseEvent::Message { event: None, data: data.into() }
    }

    fn parse_all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out: Vec<SseEvent> = chunks.iter().flat_map(|c| p.push(c)).collect();
        out.extend(p.finish());
        out
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        // Two events (one with a multi-byte character), a comment, CRLF endings, then [DONE].
        let stream =
            "data: {\"t\":\"h\u{e9}llo\"}\n\n: keep-alive\n\ndata: {\"t\":\"x\"}\r\n\r\ndata: [DONE]\n\n".as_bytes();
        let want = vec![msg("{\"t\":\"h\u{e9}llo\"}"), msg("{\"t\":\"x\"}"), SseEvent::Done];
        assert_eq!(parse_all(&[stream]), want);
        for i in 0..stream.len() {
            for j in i..stream.len() {
                assert_eq!(parse_all(&[&stream[..i], &stream[i..j], &stream[j..]]), want, "split at {i},{j}");
            }
        }
        // One byte per read.
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(parse_all(&bytes), want);
    }

    #[test]
    fn multi_line_data_event_names_and_unterminated_last_event() {
        let got = parse_all(&[b"event: error\ndata: a\ndata:b\n\ndata: tail"]);
        assert_eq!(got, vec![SseEvent::Message { event: Some("error".into()), data: "a\nb".into() }, msg("tail")]);
    }

    #[test]
    fn blank_lines_without_data_dispatch_nothing() {
        assert_eq!(parse_all(&[b"\n\n: ping\n\nid: 3\n\n"]), vec![]);
    }
}
