//! Structured-output fields of both generation endpoints: OpenAI's `response_format` and vLLM's
//! `structured_outputs` and older `guided_*` names, turned into one engine [`Constraint`] and
//! compiled into its [`Guide`] before anything is queued (what llguidance refuses is a 400
//! naming the field, with llguidance's reason).

use crate::http::errors::ApiError;
use crate::http::json;
use serde::Deserialize;
use serde_json::Value;
use tessera_engine::structured::{Constraint, Grammars, Guide};

/// The fields, as sent.
#[derive(Debug, Default, Deserialize)]
struct Fields {
    response_format: Option<ResponseFormat>,
    structured_outputs: Option<StructuredOutputs>,
    guided_json: Option<Value>,
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    guided_grammar: Option<String>,
    guided_whitespace_pattern: Option<String>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Deserialize)]
struct ResponseFormat {
    #[serde(rename = "type")]
    kind: String,
    json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`.
#[derive(Debug, Deserialize)]
struct JsonSchemaFormat {
    schema: Option<Value>,
}

/// vLLM's `structured_outputs`.
#[derive(Debug, Default, Deserialize)]
struct StructuredOutputs {
    json: Option<Value>,
    regex: Option<String>,
    choice: Option<Vec<String>>,
    grammar: Option<String>,
    json_object: Option<bool>,
    structural_tag: Option<Value>,
    whitespace_pattern: Option<String>,
}

/// A JSON schema given as an object or as a string holding one (vLLM takes both).
fn schema(param: &str, v: &Value) -> Result<Constraint, ApiError> {
    match v {
        Value::String(s) => serde_json::from_str(s)
            .map(Constraint::JsonSchema)
            .map_err(|e| ApiError::invalid(param, format!("{param} is not valid JSON: {e}"))),
        Value::Object(_) | Value::Bool(_) => Ok(Constraint::JsonSchema(v.clone())),
        _ => Err(ApiError::invalid(param, format!("{param} must be a JSON schema (an object)"))),
    }
}

impl Fields {
    /// Every constraint the body sets, each with the field that set it.
    fn constraints(self) -> Result<Vec<(String, Constraint)>, ApiError> {
        if self.guided_whitespace_pattern.is_some() {
            return Err(ApiError::invalid("guided_whitespace_pattern", "guided_whitespace_pattern is not supported"));
        }
        let mut out = Vec::new();
        if let Some(rf) = self.response_format {
            match (rf.kind.as_str(), rf.json_schema) {
                ("text", _) => {}
                ("json_object", _) => out.push(("response_format".to_owned(), Constraint::JsonObject)),
                ("json_schema", Some(JsonSchemaFormat { schema: Some(s) })) => {
                    let param = "response_format.json_schema.schema";
                    out.push((param.to_owned(), schema(param, &s)?));
                }
                ("json_schema", _) => {
                    return Err(ApiError::invalid("response_format.json_schema", "response_format of type json_schema needs json_schema.schema"));
                }
                (other, _) => {
                    return Err(ApiError::invalid(
                        "response_format.type",
                        format!("response_format type {other:?} is not supported (text, json_object or json_schema)"),
                    ));
                }
            }
        }
        if let Some(so) = self.structured_outputs {
            for (f, set) in [("structural_tag", so.structural_tag.is_some()), ("whitespace_pattern", so.whitespace_pattern.is_some())] {
                if set {
                    return Err(ApiError::invalid(format!("structured_outputs.{f}"), format!("structured_outputs.{f} is not supported")));
                }
            }
            if let Some(j) = so.json {
                out.push(("structured_outputs.json".into(), schema("structured_outputs.json", &j)?));
            }
            out.extend(so.regex.map(|r| ("structured_outputs.regex".into(), Constraint::Regex(r))));
            out.extend(so.choice.map(|c| ("structured_outputs.choice".into(), Constraint::Choice(c))));
            out.extend(so.grammar.map(|g| ("structured_outputs.grammar".into(), Constraint::Lark(g))));
            if so.json_object == Some(true) {
                out.push(("structured_outputs.json_object".into(), Constraint::JsonObject));
            }
        }
        if let Some(j) = self.guided_json {
            out.push(("guided_json".into(), schema("guided_json", &j)?));
        }
        out.extend(self.guided_regex.map(|r| ("guided_regex".into(), Constraint::Regex(r))));
        out.extend(self.guided_choice.map(|c| ("guided_choice".into(), Constraint::Choice(c))));
        out.extend(self.guided_grammar.map(|g| ("guided_grammar".into(), Constraint::Lark(g))));
        Ok(out)
    }
}

/// The request's constraint (at most one) and the field that set it.
fn constraint(value: &Value) -> Result<Option<(String, Constraint)>, ApiError> {
    let mut all = json::fields::<Fields>(value)?.constraints()?;
    if all.len() > 1 {
        let (second, _) = all.swap_remove(1);
        return Err(ApiError::invalid(second, format!("only one structured-output constraint per request; {} is already set", all[0].0)));
    }
    Ok(all.pop())
}

/// Whether the body sets a structured-output constraint.
pub fn is_set(value: &Value) -> Result<bool, ApiError> {
    Ok(constraint(value)?.is_some())
}

/// The guide for the body's structured-output fields, compiled with `grammars`; `None` when
/// the body sets none.
pub fn guide(value: &Value, grammars: Result<&Grammars, &str>) -> Result<Option<Guide>, ApiError> {
    let Some((param, c)) = constraint(value)? else { return Ok(None) };
    if let Constraint::Choice(choices) = &c {
        if choices.is_empty() || choices.iter().any(String::is_empty) {
            return Err(ApiError::invalid(param, "choices must be a non-empty list of non-empty strings"));
        }
    }
    let grammars = grammars.map_err(|e| ApiError::invalid(&param, format!("structured outputs are unavailable for this model: {e}")))?;
    grammars.compile(&c).map(Some).map_err(|e| ApiError::invalid(&param, format!("{param} was refused by the grammar compiler: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param_of(v: Value) -> Option<String> {
        constraint(&v).unwrap().map(|(p, _)| p)
    }

    #[test]
    fn every_spelling_becomes_a_constraint() {
        let schema = json!({"type": "object"});
        let cases = [
            (json!({"response_format": {"type": "json_object"}}), Constraint::JsonObject),
            (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}), Constraint::JsonSchema(schema.clone())),
            (json!({"structured_outputs": {"json": schema.to_string()}}), Constraint::JsonSchema(schema.clone())),
            (json!({"structured_outputs": {"regex": "a+"}}), Constraint::Regex("a+".into())),
            (json!({"structured_outputs": {"choice": ["a", "b"]}}), Constraint::Choice(vec!["a".into(), "b".into()])),
            (json!({"structured_outputs": {"grammar": "start: \"a\""}}), Constraint::Lark("start: \"a\"".into())),
            (json!({"structured_outputs": {"json_object": true}}), Constraint::JsonObject),
            (json!({"guided_json": schema}), Constraint::JsonSchema(schema.clone())),
            (json!({"guided_regex": "a+"}), Constraint::Regex("a+".into())),
            (json!({"guided_choice": ["a"]}), Constraint::Choice(vec!["a".into()])),
            (json!({"guided_grammar": "start: \"a\""}), Constraint::Lark("start: \"a\"".into())),
        ];
        for (body, want) in cases {
            assert_eq!(constraint(&body).unwrap().map(|(_, c)| c), Some(want), "{body}");
        }
        assert_eq!(param_of(json!({})), None);
        assert_eq!(param_of(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(param_of(json!({"guided_regex": "a"})).as_deref(), Some("guided_regex"));
    }

    #[test]
    fn bad_fields_name_themselves() {
        let cases = [
            (json!({"response_format": {"type": "yaml"}}), "response_format.type"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema"),
            (json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}), "response_format.json_schema.schema"),
            (json!({"structured_outputs": {"json": "{nope"}}), "structured_outputs.json"),
            (json!({"structured_outputs": {"structural_tag": {}}}), "structured_outputs.structural_tag"),
            (json!({"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
            (json!({"guided_choice": "a"}), "guided_choice"),
            (json!({"guided_whitespace_pattern": " "}), "guided_whitespace_pattern"),
        ];
        for (body, param) in cases {
            let e = constraint(&body).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}: {}", e.message);
        }
        let e = guide(&json!({"guided_choice": []}), Err("no")).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_choice"));
        let e = guide(&json!({"guided_regex": "a"}), Err("no EOS")).unwrap_err();
        assert!(e.message.contains("no EOS"), "{}", e.message);
    }
}
