//! QJL's registry row: `qjl1` (keys only), `qjl1-w<W>-s<S>` for the exact keys it keeps beside
//! the 1-bit sketches (window and sink, [`ExactKeyParams`]).

use super::QjlCodec;
use crate::kv::{CodecOptions, ExactKeyParams, KvCodec, KvFamily, KvFormat, KvGeometry, KvParams, KvRole, MAX_SINK};
use std::fmt;

/// `qjl1`'s window: the QJL reference's buffer of unquantized recent keys (its `buffer_size`).
const DEFAULT_WINDOW: u16 = 128;
/// `qjl1`'s sink: StreamingLLM's four attention-sink tokens.
const DEFAULT_SINK: u16 = 4;
/// The longest window a name may ask for.
const MAX_WINDOW: u16 = 8192;

/// The QJL family: its parameters are the exact keys (window, sink); `qjl1-w0-s0` is the pure
/// 1-bit cache.
pub struct Qjl1;

/// The `qjl1` format keeping `exact` keys exactly.
pub fn format(exact: ExactKeyParams) -> KvFormat {
    KvFormat::new(&Qjl1, KvParams(u64::from(exact.window) | u64::from(exact.sink) << 16))
}

fn exact(params: KvParams) -> ExactKeyParams {
    ExactKeyParams { window: params.0 as u16, sink: (params.0 >> 16) as u16 }
}

const DEFAULT: ExactKeyParams = ExactKeyParams { window: DEFAULT_WINDOW, sink: DEFAULT_SINK };

impl KvFamily for Qjl1 {
    fn family(&self) -> &'static str {
        "qjl1"
    }
    fn syntax(&self) -> &'static str {
        "qjl1[-w{0..8192}-s{0..16}]"
    }
    fn parse(&self, name: &str) -> Option<KvParams> {
        if matches!(name, "qjl1" | "qjl") {
            return Some(format(DEFAULT).params());
        }
        // qjl1-w<W>-s<S>
        let mut parts = name.strip_prefix("qjl1-")?.split('-');
        let window = parts.next()?.strip_prefix('w')?.parse().ok()?;
        let sink = parts.next()?.strip_prefix('s')?.parse().ok()?;
        if parts.next().is_some() || window > MAX_WINDOW || sink > MAX_SINK {
            return None;
        }
        Some(format(ExactKeyParams { window, sink }).params())
    }
    fn write_name(&self, params: KvParams, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match exact(params) {
            DEFAULT => f.write_str("qjl1"),
            p => write!(f, "qjl1-w{}-s{}", p.window, p.sink),
        }
    }
    fn formats(&self) -> Vec<KvParams> {
        vec![format(DEFAULT).params(), format(ExactKeyParams { window: 0, sink: 0 }).params()]
    }
    fn keys_only(&self, _params: KvParams) -> bool {
        true
    }
    fn codec(&self, _params: KvParams, geom: KvGeometry, _role: KvRole, opts: CodecOptions) -> Box<dyn KvCodec> {
        Box::new(QjlCodec::new(geom, opts))
    }
    fn exact_keys(&self, params: KvParams) -> Option<ExactKeyParams> {
        Some(exact(params))
    }
}
