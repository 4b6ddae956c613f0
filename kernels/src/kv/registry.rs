//! The registry of KV format families: parsing a name, every nameable format, and the numbering
//! of the families' CUDA pages (`TS_KV_*` codes). The built-in one is the table in
//! [`kv`](super) ([`KvRegistry::builtin`]); a registry can take more families from outside
//! ([`KvRegistry::with`]).

use super::family::{KvCuda, KvFamily, KvPageKind};
use super::{KvFormat, KvFormatError};
use std::sync::LazyLock;

/// Families, in order: their formats are tried in this order when parsing, and their CUDA pages
/// are numbered in it.
#[derive(Clone)]
pub struct KvRegistry {
    families: Vec<&'static dyn KvFamily>,
}

/// How one kind of page looks to the CUDA kernels: its code (`TS_KV_*`, attention's `K_FMT` /
/// `V_FMT` specialization and KV append's format argument) and its layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCudaPage {
    /// The kernels' format code.
    pub code: u8,
    /// Its record layout.
    pub kind: &'static KvPageKind,
}

/// One family's CUDA side in a registry, with the code of its first page.
#[derive(Clone, Copy, Debug)]
pub struct KvCudaRow {
    /// The family's name.
    pub family: &'static str,
    /// Its CUDA description.
    pub cuda: &'static KvCuda,
    /// The code of `cuda.pages[0]`; its pages take consecutive codes.
    pub first_code: u8,
}

impl KvRegistry {
    /// A registry of `families`, in order. Panics if two share a name.
    pub fn new(families: &[&'static dyn KvFamily]) -> Self {
        let mut reg = KvRegistry { families: Vec::with_capacity(families.len()) };
        for &f in families {
            reg = reg.with(f);
        }
        reg
    }

    /// The built-in families ([`FAMILIES`](super::FAMILIES)).
    pub fn builtin() -> &'static KvRegistry {
        static BUILTIN: LazyLock<KvRegistry> = LazyLock::new(|| KvRegistry::new(super::FAMILIES));
        &BUILTIN
    }

    /// This registry and `family` after it. Panics if its name is taken.
    pub fn with(&self, family: &'static dyn KvFamily) -> Self {
        assert!(self.families.iter().all(|f| f.family() != family.family()), "KV format family {} registered twice", family.family());
        let mut families = self.families.clone();
        families.push(family);
        KvRegistry { families }
    }

    /// The format `s` names (trimmed, any case, `_` or `-`): the first family that knows it.
    pub fn parse(&self, s: &str) -> Result<KvFormat, KvFormatError> {
        let name = s.trim().to_ascii_lowercase().replace('_', "-");
        self.families
            .iter()
            .find_map(|&f| f.parse(&name).map(|p| KvFormat::new(f, p)))
            .ok_or_else(|| KvFormatError::Unknown { name: s.to_string(), expected: self.syntax() })
    }

    /// Every format a user can name, family by family.
    pub fn all(&self) -> Vec<KvFormat> {
        self.families.iter().flat_map(|&f| f.formats().into_iter().map(move |p| KvFormat::new(f, p))).collect()
    }

    /// The names it accepts, as the unknown-name error lists them (`a, b or c`).
    pub fn syntax(&self) -> String {
        let names: Vec<&str> = self.families.iter().map(|f| f.syntax()).collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.concat(),
        }
    }

    /// The families with a CUDA side, in order, each with the code of its first page.
    pub fn cuda_rows(&self) -> Vec<KvCudaRow> {
        let mut next = 0usize;
        let mut rows = Vec::new();
        for f in &self.families {
            if let Some(cuda) = f.cuda() {
                let first_code = u8::try_from(next).expect("at most 256 KV page codes");
                rows.push(KvCudaRow { family: f.family(), cuda, first_code });
                next += cuda.pages.len();
            }
        }
        rows
    }

    /// Every kind of CUDA page, in code order (its index is its code).
    pub fn cuda_pages(&self) -> Vec<KvCudaPage> {
        self.cuda_rows().into_iter().flat_map(|r| r.cuda.pages.iter().enumerate().map(move |(i, kind)| KvCudaPage { code: r.first_code + i as u8, kind })).collect()
    }

    /// The CUDA pages of `format` (with the checkpoint's static scale if `static_scale`, for
    /// the formats that use one), or `None` where its family has no CUDA side in this registry.
    pub fn cuda_page(&self, format: &KvFormat, static_scale: bool) -> Option<KvCudaPage> {
        let family = format.family();
        let row = self.cuda_rows().into_iter().find(|r| r.family == family.family())?;
        let i = family.cuda_page(format.params(), static_scale)?;
        Some(KvCudaPage { code: row.first_code + u8::try_from(i).ok()?, kind: &row.cuda.pages[i] })
    }
}
