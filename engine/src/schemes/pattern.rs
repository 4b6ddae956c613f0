//! Module-name patterns of quantization configs: exact names, `re:` regular expressions
//! (Python `re.match`: anchored at the start), and fnmatch globs (`*`, `?`, `[...]` over the
//! whole name, `*` crossing dots), as compressed-tensors, vLLM/SGLang and Quark use them.

use crate::checkpoint::LoadError;

/// One compiled pattern.
#[derive(Clone, Debug)]
pub enum NamePattern {
    /// Whole-name equality (and suffix match on a `.` boundary, so `lm_head` matches
    /// `model.lm_head` as newer vLLM accepts).
    Exact(String),
    /// `re:` pattern, matched from the start of the name.
    Regex(regex::Regex),
    /// fnmatch glob over the whole name.
    Glob(String),
}

impl NamePattern {
    /// Compiles a pattern; `key` names the config entry for errors.
    pub fn parse(p: &str, key: &str) -> Result<Self, LoadError> {
        if let Some(re) = p.strip_prefix("re:") {
            let r = regex::Regex::new(&format!("^(?:{re})"))
                .map_err(|e| LoadError::Config { key: key.into(), msg: format!("bad regex {p:?}: {e}") })?;
            Ok(NamePattern::Regex(r))
        } else if p.contains(['*', '?', '[']) {
            Ok(NamePattern::Glob(p.to_string()))
        } else {
            Ok(NamePattern::Exact(p.to_string()))
        }
    }

    /// Whether the module name matches.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            NamePattern::Exact(e) => name == e || name.strip_suffix(e.as_str()).is_some_and(|h| h.ends_with('.')),
            NamePattern::Regex(r) => r.is_match(name),
            NamePattern::Glob(g) => fnmatch(g.as_bytes(), name.as_bytes()),
        }
    }
}

/// Parses a JSON list of pattern strings (absent or null = empty).
pub fn parse_list(v: Option<&serde_json::Value>, key: &str) -> Result<Vec<NamePattern>, LoadError> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|p| {
                p.as_str()
                    .ok_or_else(|| LoadError::Config { key: key.into(), msg: format!("{p} is not a string") })
                    .and_then(|s| NamePattern::parse(s, key))
            })
            .collect(),
        Some(other) => Err(LoadError::Config { key: key.into(), msg: format!("{other} is not a list") }),
    }
}

/// Whether any pattern matches.
pub fn any_match(patterns: &[NamePattern], name: &str) -> bool {
    patterns.iter().any(|p| p.matches(name))
}

/// Python's `fnmatch.fnmatchcase`: `*` any run, `?` one character, `[seq]` / `[!seq]` a set.
pub fn fnmatch(p: &[u8], s: &[u8]) -> bool {
    // Iterative matcher with single-star backtracking.
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() {
            match p[pi] {
                b'*' => {
                    star = Some((pi, si));
                    pi += 1;
                    continue;
                }
                b'?' => {
                    pi += 1;
                    si += 1;
                    continue;
                }
                b'[' => {
                    if let Some((ok, next)) = class(&p[pi..], s[si]) {
                        if ok {
                            pi += next;
                            si += 1;
                            continue;
                        }
                    } else if s[si] == b'[' {
                        pi += 1;
                        si += 1;
                        continue;
                    }
                }
                c if c == s[si] => {
                    pi += 1;
                    si += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((sp, ss)) => {
                pi = sp + 1;
                si = ss + 1;
                star = Some((sp, ss + 1));
            }
            None => return false,
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// Matches `c` against the class at the start of `p` (`[...]`): `(matched, class length)`,
/// or `None` when the bracket is unterminated (then it is a literal `[`).
fn class(p: &[u8], c: u8) -> Option<(bool, usize)> {
    let mut i = 1;
    let negate = p.get(i) == Some(&b'!');
    if negate {
        i += 1;
    }
    let start = i;
    let mut hit = false;
    while i < p.len() && (p[i] != b']' || i == start) {
        if i + 2 < p.len() && p[i + 1] == b'-' && p[i + 2] != b']' {
            hit |= p[i] <= c && c <= p[i + 2];
            i += 3;
        } else {
            hit |= p[i] == c;
            i += 1;
        }
    }
    (i < p.len()).then_some((hit != negate, i + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnmatch_follows_python() {
        // Cases checked against Python 3's fnmatch.fnmatchcase.
        let cases = [
            ("*mlp.gate", "model.layers.0.mlp.gate", true),
            ("*mlp.gate", "model.layers.0.mlp.gate_proj", false),
            ("*mlp.up_proj", "model.layers.1.mlp.experts.42.up_proj", false),
            ("*mlp.up_proj", "model.layers.0.mlp.up_proj", true),
            ("*self_attn*", "model.layers.3.self_attn.q_proj", true),
            ("*shared_experts*", "model.layers.3.mlp.shared_experts.down_proj", true),
            ("*lm_head", "lm_head", true),
            ("model.layers.?.mlp.*", "model.layers.7.mlp.down_proj", true),
            ("model.layers.?.mlp.*", "model.layers.17.mlp.down_proj", false),
            ("*.[qk]_proj", "a.q_proj", true),
            ("*.[!qk]_proj", "a.q_proj", false),
            ("*.[!qk]_proj", "a.v_proj", true),
            ("layer[0-2]", "layer1", true),
            ("layer[0-2]", "layer3", false),
            ("a[b", "a[b", true),
            ("", "", true),
            ("*", "", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
        ];
        for (p, s, want) in cases {
            assert_eq!(fnmatch(p.as_bytes(), s.as_bytes()), want, "fnmatch({p:?}, {s:?})");
        }
    }

    #[test]
    fn pattern_kinds() {
        let m = |p: &str, s: &str| NamePattern::parse(p, "k").unwrap().matches(s);
        assert!(m("re:.*mlp.gate$", "model.layers.0.mlp.gate"));
        assert!(!m("re:.*mlp.gate$", "model.layers.0.mlp.gate_proj"));
        assert!(m("re:model.layers.1", "model.layers.12.mlp"), "re: matches from the start, not the whole name");
        assert!(!m("re:layers", "model.layers.1"));
        assert!(m("lm_head", "lm_head"));
        assert!(m("lm_head", "model.lm_head"));
        assert!(!m("lm_head", "model.xlm_head"));
        assert!(NamePattern::parse("re:(", "ignore").is_err());
    }
}
