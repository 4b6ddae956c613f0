//! A weight format added by the recipe in `docs/architecture.md` ("Adding a weight format")
//! and nothing else: a 2-bit format with one scale per row, written here, outside the crate,
//! implementing [`RowKernel`] only. Without one line changed in `tessera_kernels`, it is a
//! [`WeightMatrix`] that picks its op, runs fused with GGML and int4 layers, prints its plan,
//! and cuts for tensor parallelism. Its CUDA side (recipe step 3) is a [`CudaFormat`] with a
//! kernel source of its own: the planes its upload hands over are checked, and the source
//! compiles with NVRTC (the kernel is not run here: that needs a device).
//!
//! Reference: an f64 sum over the format's own scalar dequantization. Tolerance: each output
//! is an f32 sum of `cols` products, so `cols · eps · Σ|w·x|` bounds its error against the
//! f64 sum (eps = 2^-24; the kernels below accumulate in f32 in column order).

use crate::common::{random_weights, randn, rng};
use rand::Rng;
use std::ops::Range;
use std::sync::Arc;
use tessera_kernels::cpu::{CpuCaps, Isa};
use tessera_kernels::cuda::device::CudaDevice;
use cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};
use tessera_kernels::cuda::source::KernelSource;
use tessera_kernels::linear::cuda::{shape, Activations, CudaAct, CudaFormat, DevicePlanes, DeviceWeight, Dims, QuantPlanes};
use tessera_kernels::cuda::CudaError;
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::ggml::GgmlMatrix;
use tessera_kernels::linear::{forward_fused, ActQuant, LinearOp, LinearPolicy, Prepared, RowKernel, WeightMatrix};

/// `W[r, c] = q[r, c] * s[r]` with `q` in -2..=1.
#[derive(Debug)]
struct Int2Rows {
    rows: usize,
    cols: usize,
    q: Vec<i8>,
    scales: Vec<f32>,
}

impl RowKernel for Int2Rows {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        self.rows * self.cols / 4 + 4 * self.rows
    }

    fn storage(&self) -> String {
        "int2 channel".into()
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        for (o, &q) in out.iter_mut().zip(&self.q[r * self.cols..(r + 1) * self.cols]) {
            *o = f32::from(q) * self.scales[r];
        }
    }

    fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Self, String> {
        let q = rows.clone().flat_map(|r| self.q[r * self.cols + cols.start..r * self.cols + cols.end].iter().copied()).collect();
        Ok(Int2Rows { rows: rows.len(), cols: cols.len(), q, scales: self.scales[rows].to_vec() })
    }

    fn accepts(&self, act: ActQuant) -> bool {
        act == ActQuant::F32
    }

    fn row_range(&self, _isa: Isa, act: &Prepared<'_>, r0: usize, r1: usize, m: usize, tile: &mut [f32]) {
        let Prepared::F32(x) = act else { unreachable!("f32 activations only (accepts)") };
        let mut w = vec![0f32; self.cols];
        for r in r0..r1 {
            RowKernel::dequantize_row(self, r, &mut w);
            for i in 0..m {
                tile[(r - r0) * m + i] = w.iter().zip(&x[i * self.cols..(i + 1) * self.cols]).map(|(a, b)| a * b).sum();
            }
        }
    }

    fn kernel_id(&self, _act: ActQuant, _isa: Isa) -> String {
        "cpu.toy-int2xf32.scalar".into()
    }

    fn upload(&self, dev: &CudaDevice, act: ActQuant) -> Result<DeviceWeight, CudaError> {
        if act != ActQuant::F32 {
            return Err(CudaError::Shape(format!("no CUDA kernel for int2 weights with {} activations", act.name())));
        }
        DeviceWeight::from_planes(dev, self.planes())
    }
}

impl Int2Rows {
    /// The planes its CUDA kernel reads: one signed byte per value, one f32 scale per row.
    fn planes(&self) -> QuantPlanes {
        QuantPlanes {
            format: Box::new(Int2Cuda),
            storage: RowKernel::storage(self),
            rows: self.rows,
            cols: self.cols,
            codes: self.q.iter().map(|&q| q as u8).collect(),
            block_scales: None,
            scales: self.scales.clone(),
            zeros: None,
        }
    }
}

/// The toy's kernel: one warp per output row, f32 activations, `y = s[row] · Σ q·x`.
static INT2_SOURCE: KernelSource = KernelSource {
    name: "toy_int2.cu",
    code: r#"
#define TS_MT 8
#define TS_WARPS 8
extern "C" __global__ void __launch_bounds__(TS_WARPS * 32)
int2_matmul(const int8_t* wq, const float* ws, const float* x, float* y, int n, int k, int m) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * TS_WARPS + threadIdx.x / 32;
    if (row >= n) return;
    const int t0 = blockIdx.y * TS_MT;
    const int mt = min(TS_MT, m - t0);
    for (int t = 0; t < mt; ++t) {
        float acc = 0.0f;
        for (int c = lane; c < k; c += 32) acc += (float)wq[(int64_t)row * k + c] * x[(int64_t)(t0 + t) * k + c];
        acc = ts_warp_sum(acc);
        if (lane == 0) y[(int64_t)(t0 + t) * n + row] = acc * ws[row];
    }
}
"#,
    variants: &[&[]],
    entries: &["int2_matmul"],
    needs_sm90a: false,
};

/// The toy's CUDA description.
#[derive(Debug)]
struct Int2Cuda;

impl CudaFormat for Int2Cuda {
    fn source(&self) -> &'static KernelSource {
        &INT2_SOURCE
    }

    fn kernel_id(&self) -> String {
        "cuda.toy-int2xf32".into()
    }

    fn activations(&self) -> CudaAct {
        CudaAct::F32
    }

    fn check(&self, p: &QuantPlanes) -> Result<(), CudaError> {
        if p.codes.iter().any(|&b| !(-2..=1).contains(&(b as i8))) {
            return Err(shape("int2 codes outside -2..=1"));
        }
        p.expect_lens(p.rows * p.cols, None, p.rows, None)
    }

    fn launch_matmul(
        &self,
        dev: &CudaDevice,
        w: &DevicePlanes,
        x: Activations<'_>,
        y: &mut CudaViewMut<'_, f32>,
        dims: Dims,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        let Activations::F32(x) = x else { return Err(shape("int2 takes f32 activations")) };
        let f = dev.function(&INT2_SOURCE, &[], "int2_matmul")?;
        let scales = w.scales.as_ref().ok_or_else(|| shape("int2 weights carry scales"))?;
        let Dims { n, k, m } = dims;
        let mut b = dev.stream().launch_builder(&f);
        b.arg(&w.codes).arg(scales).arg(x).arg(y).arg(&n).arg(&k).arg(&m);
        // SAFETY: argument types and order match `int2_matmul`; the launcher checked lengths,
        // the planes were checked at upload.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// The toy's CUDA side from outside the crate: its planes pass its check (and bad ones do
/// not), and its source compiles for every gate target where NVRTC is installed.
#[test]
fn a_format_adds_its_cuda_kernel_without_touching_the_launcher() {
    let mut r = rng(5);
    let w = int2(&mut r, 6, 64);
    assert!(w.planes().check().is_ok());
    let mut bad = w.planes();
    bad.scales.pop();
    assert!(bad.check().is_err());
    let mut bad = w.planes();
    bad.codes[3] = 7;
    assert!(bad.check().is_err());
    if crate::cuda_compile::nvrtc_ready() {
        for arch in tessera_kernels::cuda::CudaArch::GATE {
            let cubin = tessera_kernels::cuda::compile::compile_cubin(&INT2_SOURCE, &[], arch).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&cubin[..4], b"\x7fELF");
        }
    }
}

fn int2(r: &mut impl Rng, rows: usize, cols: usize) -> Int2Rows {
    Int2Rows {
        rows,
        cols,
        q: (0..rows * cols).map(|_| r.gen_range(-2..=1)).collect(),
        scales: (0..rows).map(|_| r.gen_range(0.01..0.1)).collect(),
    }
}

/// f64 reference and magnitude `Σ|w·x|` of `y = x · Wᵀ` over `w`'s own dequantization.
fn reference(w: &dyn LinearOp, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (w.rows(), w.cols());
    let (mut y, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
    let mut row = vec![0f32; k];
    for j in 0..n {
        w.dequantize_row(j, &mut row);
        for i in 0..m {
            for (a, b) in row.iter().zip(&x[i * k..(i + 1) * k]) {
                y[i * n + j] += f64::from(*a) * f64::from(*b);
                mag[i * n + j] += (f64::from(*a) * f64::from(*b)).abs();
            }
        }
    }
    (y, mag)
}

#[test]
fn a_format_added_by_the_recipe_runs_beside_the_built_in_ones() {
    let mut r = rng(42);
    let (k, caps, policy) = (128, CpuCaps::detect(), LinearPolicy::DEFAULT);
    let toy: Arc<dyn WeightMatrix> = Arc::new(int2(&mut r, 24, k));
    assert_eq!((toy.storage(), toy.col_align(), toy.row_align()), ("int2 channel".to_string(), 32, 1));
    let toy_op = toy.clone().op(ActQuant::F32, None, &caps, policy).unwrap();
    let plan = toy_op.plan();
    assert_eq!((plan.storage.as_str(), plan.activations.as_str(), plan.kernel.as_str()), ("int2 channel", "f32", "cpu.toy-int2xf32.scalar"));
    // Refusals come from the format's own answers.
    assert!(toy.clone().op(ActQuant::Int8PerToken, None, &caps, policy).unwrap_err().contains("int2 channel"));

    // Fused with a GGML Q4_1 layer and an int4 layer reading the same input (a Q/K/V-like
    // group): every layer's outputs are its own product, to the stated bound.
    let q41: Arc<dyn WeightMatrix> = Arc::new(GgmlMatrix::new(GgmlType::Q4_1, 16, k, Arc::new(random_weights(&mut r, GgmlType::Q4_1, 16, k))).unwrap());
    let i4: Arc<dyn WeightMatrix> = Arc::new(crate::common::int4(&mut r, 8, k, 32, true));
    let ops = [toy_op, q41.op(ActQuant::F32, None, &caps, LinearPolicy::ALWAYS_GEMM).unwrap(), i4.op(ActQuant::F32, None, &caps, LinearPolicy::ALWAYS_GEMM).unwrap()];
    let m = 5;
    let x = randn(&mut r, m * k);
    let width = 24 + 16 + 8 + 3;
    let mut y = vec![f32::NAN; m * width];
    let parts: Vec<(&dyn LinearOp, usize)> = vec![(&*ops[0], 0), (&*ops[1], 24), (&*ops[2], 40)];
    forward_fused(&parts, &x, &[2, 3], &mut y, width);
    for &(op, col) in &parts {
        let (want, mag) = reference(op, &x, m);
        let n = op.rows();
        for i in 0..m {
            for j in 0..n {
                let (got, w, s) = (y[i * width + col + j], want[i * n + j], mag[i * n + j]);
                assert!((f64::from(got) - w).abs() <= k as f64 * f64::from(f32::EPSILON) * s + 1e-30, "{} token {i} row {j}: {got} vs {w}", op.plan().kernel);
            }
        }
    }
    assert!(y.chunks_exact(width).all(|row| row[48..].iter().all(|v| v.is_nan())), "columns past the layers untouched");

    // Tensor-parallel cuts: two column halves sum to the whole, row halves stack to it.
    let whole = {
        let mut y = vec![0f32; m * 24];
        forward_fused(&[(&*toy.clone().op(ActQuant::F32, None, &caps, policy).unwrap(), 0)], &x, &[m], &mut y, 24);
        y
    };
    let half = |rows: Range<usize>, cols: Range<usize>| {
        let part = toy.slice(rows.clone(), cols.clone()).unwrap().op(ActQuant::F32, None, &caps, policy).unwrap();
        let xs: Vec<f32> = x.chunks_exact(k).flat_map(|t| t[cols.clone()].to_vec()).collect();
        let mut y = vec![0f32; m * rows.len()];
        forward_fused(&[(&*part, 0)], &xs, &[m], &mut y, rows.len());
        y
    };
    let (a, b) = (half(0..24, 0..64), half(0..24, 64..128));
    for i in 0..m * 24 {
        let s: f32 = x[(i / 24) * k..(i / 24 + 1) * k].iter().map(|v| v.abs()).sum::<f32>() * 0.2;
        assert!((a[i] + b[i] - whole[i]).abs() <= k as f32 * f32::EPSILON * s, "column halves at {i}");
    }
    let (top, bottom) = (half(0..8, 0..128), half(8..24, 0..128));
    for i in 0..m {
        assert_eq!(&whole[i * 24..i * 24 + 8], &top[i * 8..(i + 1) * 8]);
        assert_eq!(&whole[i * 24 + 8..(i + 1) * 24], &bottom[i * 16..(i + 1) * 16]);
    }
    // The driver's own checks apply to any format: cuts off the kernels' 32-column runs.
    assert!(toy.slice(0..24, 16..128).unwrap_err().contains("32-column runs"));
}

/// Ops of different formats write in parallel into one output: overlapping columns are refused
/// before any of them runs.
#[test]
#[should_panic(expected = "output columns overlap")]
fn fused_ops_of_any_formats_may_not_overlap() {
    let mut r = rng(7);
    let (caps, policy) = (CpuCaps::detect(), LinearPolicy::DEFAULT);
    let toy = Arc::new(int2(&mut r, 8, 64)).op(ActQuant::F32, None, &caps, policy).unwrap();
    let f32s: Arc<dyn WeightMatrix> = Arc::new(GgmlMatrix::new(GgmlType::F32, 8, 64, Arc::new(random_weights(&mut r, GgmlType::F32, 8, 64))).unwrap());
    let dense = f32s.op(ActQuant::F32, None, &caps, policy).unwrap();
    let x = randn(&mut r, 64);
    let mut y = vec![0f32; 16];
    forward_fused(&[(&*toy, 0), (&*dense, 4)], &x, &[1], &mut y, 16);
}
