//! Hugging Face chat templates (Jinja) rendered with minijinja the way `transformers` renders
//! them: `trim_blocks`/`lstrip_blocks`, Python string methods (`.strip()`, ...), `raise_exception`,
//! `bos_token`/`eos_token`, and `add_generation_prompt=True`.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// One message as the template sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// Text content.
    pub content: String,
    /// Optional participant name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's tool calls, as the client sent them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` turn answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A compiled chat template with the model's special-token texts.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    limits: RenderLimits,
}

/// Bounds on one rendering. The template comes with the model file: these keep a broken or
/// hostile one (an endless loop, runaway recursion, a huge output) from hanging a request or
/// exhausting memory; rendering fails with an error that names the limit instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenderLimits {
    /// Template instructions one rendering may execute (minijinja's fuel).
    pub fuel: u64,
    /// Largest rendered prompt, in bytes.
    pub max_output_bytes: usize,
    /// Deepest nesting of macro calls and loops (minijinja caps it at 500).
    pub max_depth: usize,
}

impl Default for RenderLimits {
    /// Far above what real templates need: SmolLM2's spends about 20 instructions per message,
    /// so 20 million is a conversation of a million messages (more than a request body holds);
    /// 64 MiB of prompt is far past any context length; 64 levels of nesting stay well inside
    /// a tokio worker's 2 MiB stack.
    fn default() -> Self {
        RenderLimits { fuel: 20_000_000, max_output_bytes: 64 << 20, max_depth: 64 }
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source` with the default [`RenderLimits`]; the error describes the syntax problem.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, String> {
        Self::with_limits(source, bos_token, eos_token, RenderLimits::default())
    }

    /// Compiles `source`, to be rendered within `limits`.
    pub fn with_limits(source: &str, bos_token: &str, eos_token: &str, limits: RenderLimits) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_fuel(Some(limits.fuel));
        env.set_recursion_limit(limits.max_depth);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("range", range);
        env.add_template_owned(NAME, source.to_owned()).map_err(|e| format!("the chat template does not compile: {e}"))?;
        Ok(ChatTemplate { env, bos_token: bos_token.to_owned(), eos_token: eos_token.to_owned(), limits })
    }

    /// The prompt text for `messages`, ending with the assistant's turn opener when
    /// `add_generation_prompt`; `tools` and `reasoning_effort` are the template's variables of
    /// those names (none when not given), as transformers passes them. The error is the template's own complaint (e.g. from
    /// `raise_exception`), a limit of [`RenderLimits`] reached, or another rendering failure.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool, tools: Option<&serde_json::Value>, reasoning_effort: Option<&str>) -> Result<String, String> {
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        let mut out = BoundedWriter { buf: Vec::new(), limit: self.limits.max_output_bytes };
        // `tools` as transformers passes them: the request's list, or none.
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            tools => tools,
            reasoning_effort => reasoning_effort,
        };
        tmpl.render_captured_to(ctx, &mut out).map_err(|e| match e.kind() {
            ErrorKind::OutOfFuel => format!(
                "rendering the chat template was stopped after {} instructions (an endless or very long loop?)",
                self.limits.fuel
            ),
            ErrorKind::WriteFailure => {
                format!("the rendered chat template exceeds {} bytes", self.limits.max_output_bytes)
            }
            ErrorKind::InvalidOperation => e.detail().unwrap_or("the chat template rejected the messages").to_owned(),
            _ => format!("rendering the chat template failed: {e}"),
        })?;
        String::from_utf8(out.buf).map_err(|_| "the rendered chat template is not valid UTF-8".to_owned())
    }

    /// The text to tokenize: when tokenization will prepend BOS itself (`add_bos`) and the
    /// template already wrote the BOS text, that text is dropped so the prompt has one BOS.
    pub fn without_duplicate_bos<'a>(&self, rendered: &'a str, add_bos: bool) -> &'a str {
        match rendered.strip_prefix(self.bos_token.as_str()) {
            Some(rest) if add_bos && !self.bos_token.is_empty() => rest,
            _ => rendered,
        }
    }
}

/// Most items `range` makes. minijinja's own allows 100,000, and one `x in range(100000)` is a
/// single instruction (one unit of fuel) that compares 100,000 values: a loop of those took
/// over 10 s per input under the fuzz target's small fuel (its first finding), and would take
/// hours under the server's. Chat templates iterate over messages, not long ranges.
///
/// Fuel counts instructions, not time: an instruction over a 10,000-item list or a long string
/// (minijinja repeats strings up to 100 MB) still costs far more than one unit, so a hostile
/// template can still be slow within the limits; bounding wall time needs rendering off the
/// request thread with a deadline (not done yet).
pub const MAX_RANGE: i128 = 10_000;

/// Python's `range(stop)` / `range(start, stop[, step])` as a list of at most [`MAX_RANGE`] items.
fn range(first: i64, stop: Option<i64>, step: Option<i64>) -> Result<minijinja::Value, Error> {
    let (start, stop) = match stop {
        Some(stop) => (i128::from(first), i128::from(stop)),
        None => (0, i128::from(first)),
    };
    let step = i128::from(step.unwrap_or(1));
    if step == 0 {
        return Err(Error::new(ErrorKind::InvalidOperation, "range() step must not be zero"));
    }
    let span = if step > 0 { stop - start } else { start - stop };
    let len = if span > 0 { (span - 1) / step.abs() + 1 } else { 0 };
    if len > MAX_RANGE {
        return Err(Error::new(ErrorKind::InvalidOperation, format!("range() of {len} items (at most {MAX_RANGE})")));
    }
    // Each item lies between start and stop, both i64.
    Ok((0..len).map(|i| (start + i * step) as i64).collect::<Vec<i64>>().into())
}

/// Collects output up to a byte limit; writing past it fails.
struct BoundedWriter {
    buf: Vec<u8>,
    limit: usize,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.limit {
            return Err(std::io::Error::other("output limit reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template (as in the default model's GGUF).
    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
    }

    #[test]
    fn reasoning_effort_reaches_the_template() {
        let t = ChatTemplate::new("{% if reasoning_effort is none %}default{% else %}effort={{ reasoning_effort }}{% endif %}", "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "x")], false, None, None).unwrap(), "default");
        assert_eq!(t.render(&[msg("user", "x")], false, None, Some("high")).unwrap(), "effort=high");
    }

    #[test]
    fn tools_and_tool_turns_reach_the_template() {
        let src = "{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}[{{ m.role }} {{ m.tool_call_id }} {{ m.tool_calls[0].function.name if m.tool_calls else '' }}]{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather"}}]);
        let call = serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]);
        let msgs = [
            ChatMessage { tool_calls: Some(call), ..msg("assistant", "") },
            ChatMessage { tool_call_id: Some("c1".into()), ..msg("tool", "sunny") },
        ];
        assert_eq!(t.render(&msgs, false, Some(&tools), None).unwrap(), "get_weather;[assistant  get_weather][tool c1 ]");
        // Without tools the variable is none, as transformers passes it (`tools=None`).
        let plain = ChatTemplate::new("{% if tools is none %}none{% else %}tools{% endif %}", "", "").unwrap();
        assert_eq!(plain.render(&[msg("user", "x")], false, None, None).unwrap(), "none");
    }

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, "<|endoftext|>", "<|im_end|>").unwrap();
        assert_eq!(
            t.render(&[msg("user", "Hi")], true, None, None).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&[msg("system", "Be brief."), msg("user", "Hi")], true, None, None).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_block_trimming_special_tokens_and_raise_exception() {
        // A Llama-2-style template: whitespace control, .strip(), bos/eos, role alternation check.
        let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}\n        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n    {% endif %}\n    {% if m['role'] == 'user' %}\n        {{ '[INST] ' + m['content'].strip() + ' [/INST]' }}\n    {% else %}\n        {{ ' ' + m['content'].strip() + ' ' + eos_token }}\n    {% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t.render(&[msg("user", "  a  "), msg("assistant", " b "), msg("user", "c")], true, None, None).unwrap();
        assert_eq!(
            out.split_whitespace().collect::<Vec<_>>().join(" "),
            "<s> [INST] a [/INST] b </s> [INST] c [/INST]"
        );
        let err = t.render(&[msg("assistant", "x")], true, None, None).unwrap_err();
        assert_eq!(err, "Conversation roles must alternate user/assistant/user/assistant/...");
    }

    #[test]
    fn syntax_errors_are_reported_at_compile_time() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").err().unwrap();
        assert!(err.contains("does not compile"), "{err}");
    }

    #[test]
    fn names_reach_the_template() {
        let t = ChatTemplate::new("{% for m in messages %}{{ m.name or '-' }}:{{ m.content }};{% endfor %}", "", "").unwrap();
        let named = ChatMessage { name: Some("ann".into()), ..msg("user", "x") };
        assert_eq!(t.render(&[named, msg("user", "y")], true, None, None).unwrap(), "ann:x;-:y;");
    }

    /// Templates that would never end, recurse without bound or render without bound fail
    /// with an error naming the limit, under the server's default limits, within seconds.
    #[test]
    fn hostile_templates_stop_at_a_limit() {
        let cases = [
            ("{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}", "20000000 instructions"),
            ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion limit exceeded"),
            ("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "recursion limit exceeded"),
            ("{% for i in range(10000) %}{% for j in range(10000) %}{{ 'x' * 10000 }}{% endfor %}{% endfor %}", "exceeds 67108864 bytes"),
            // The chat_template fuzz target's hang: `in` over a long range inside a long loop.
            ("{% for i in range(100000) %}{{ i in range(100000) }}{% endfor %}", "range() of 100000 items (at most 10000)"),
        ];
        for (src, want) in cases {
            let t = ChatTemplate::new(src, "", "").unwrap();
            let start = std::time::Instant::now();
            let err = t.render(&[msg("user", "hi")], true, None, None).unwrap_err();
            assert!(err.contains(want), "{src}: {err}");
            assert!(start.elapsed().as_secs_f64() < 10.0, "{src}: {:?}", start.elapsed());
        }
    }

    #[test]
    fn range_follows_python() {
        let t = ChatTemplate::new(
            "{{ range(3)|list }} {{ range(1, 4)|list }} {{ range(5, 0, -2)|list }} {{ range(2, 2)|list }} {{ range(0, 5, 9)|list }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&[], true, None, None).unwrap(), "[0, 1, 2] [1, 2, 3] [5, 3, 1] [] [0]");
        let extreme = ChatTemplate::new("{{ range(-9223372036854775808, 9223372036854775807, -1)|list }}{{ range(1, 2, 0) }}", "", "").unwrap();
        assert_eq!(extreme.render(&[], true, None, None).unwrap_err(), "range() step must not be zero");
        let huge = ChatTemplate::new("{{ range(-9223372036854775808, 9223372036854775807) }}", "", "").unwrap();
        assert!(huge.render(&[], true, None, None).unwrap_err().contains("at most 10000"));
    }

    /// Rendering runs on tokio worker threads (2 MiB of stack): the deepest nesting the
    /// limits allow must fit there.
    #[test]
    fn deepest_recursion_fits_a_worker_stack() {
        let src = "{% macro f(n) %}{% for m in messages %}{% if m.content %}{{ f(n + 1) }}{% endif %}{% endfor %}{% endmacro %}{{ f(0) }}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let err = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || t.render(&[msg("user", "x")], true, None, None))
            .unwrap()
            .join()
            .expect("no stack overflow")
            .unwrap_err();
        assert!(err.contains("recursion limit exceeded"), "{err}");
    }

    #[test]
    fn bos_written_by_the_template_is_not_doubled() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        assert_eq!(t.without_duplicate_bos("<s>[INST] hi", true), "[INST] hi");
        assert_eq!(t.without_duplicate_bos("<s>[INST] hi", false), "<s>[INST] hi");
        assert_eq!(t.without_duplicate_bos("[INST] hi", true), "[INST] hi");
        let no_bos = ChatTemplate::new(CHATML, "", "</s>").unwrap();
        assert_eq!(no_bos.without_duplicate_bos("[INST] hi", true), "[INST] hi");
    }
}
