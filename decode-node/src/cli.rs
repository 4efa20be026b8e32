//! Command line of `decode-node`. Every flag of every subcommand also reads
//! `DECODE_NODE_<FLAG>` from the environment ([`command`] adds what the derives do not name),
//! and switches take `1/0`, `true/false`, `yes/no`, `on/off` there.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, Args, CommandFactory, FromArgMatches, Parser, Subcommand};

/// The environment variable a flag reads: `DECODE_NODE_` and the long name in capitals.
pub fn env_name(long: &str) -> String {
    format!("DECODE_NODE_{}", long.to_uppercase().replace('-', "_"))
}

/// The whole command tree, every flag given its environment variable and every switch a
/// value parser that takes the usual spellings of true and false (clap's own takes only
/// `true`/`false`, so `DECODE_NODE_EXACT=1` stopped start-up).
pub fn command() -> clap::Command {
    fn with_env(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|a| {
            let Some(long) = a.get_long().map(str::to_owned) else {
                return a;
            };
            let a = if a.get_env().is_none() {
                a.env(env_name(&long))
            } else {
                a
            };
            if matches!(a.get_action(), ArgAction::SetTrue) {
                a.value_parser(BoolishValueParser::new())
            } else {
                a
            }
        })
        .mut_subcommands(with_env)
    }
    with_env(Cli::command())
}

impl Cli {
    /// Parses the process's arguments and environment through [`command`]; exits with
    /// clap's message on an error, as `Parser::parse` does.
    pub fn parse_with_env() -> Self {
        let matches = command().get_matches();
        Self::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }
}

/// Decode node for prefill–decode disaggregated LLM serving.
///
/// Prefill nodes push a prompt's KV cache over gRPC (KvTransfer.PushKv) into host DRAM;
/// this node decodes with ScoutAttention (hot KV blocks on the device, the rest attended on
/// the CPU, merged exactly) and streams tokens to the orchestrator (Decode.Generate).
#[derive(Debug, Parser)]
#[command(name = "decode-node", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// Log format.
    #[arg(long, env = "DECODE_NODE_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"], global = true)]
    pub log_format: String,
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the decode node: KvTransfer and Decode over gRPC, metrics over HTTP.
    Serve(ServeArgs),
    /// Reference prefill node: run a prompt through the model and push its KV to a node.
    Prefill(PrefillArgs),
    /// Orchestrator client: start a generation on a node and print tokens as they stream.
    Generate(GenerateArgs),
    /// Serve, prefill and generate in one process on the embedded model; prints a summary.
    Demo(DemoArgs),
    /// Benchmarks that report ratios against a bound measured in the same run.
    Bench(BenchArgs),
    /// Write a random-weight model in Hugging Face format (config.json, model.safetensors).
    MakeModel(MakeModelArgs),
    /// Check a device backend against the CPU backend: every device kernel on random inputs,
    /// then greedy decodes that must stream the same tokens. Prints PASS/FAIL per check.
    Selftest(SelftestArgs),
}

/// Model and attention settings shared by every command that runs the model.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Model: a Hugging Face model directory, a Llama GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1;
    /// quantized tensors are dequantized to bf16 at load), or `tiny` (embedded deterministic model).
    #[arg(long, env = "DECODE_NODE_MODEL", default_value = "tiny")]
    pub model: String,
    /// Compute device: `cpu`, or `cuda[:N]` (needs a build with `--features cuda`).
    #[arg(long, env = "DECODE_NODE_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Attention split: `scout`, `full` (all KV on device), `hgca`, `recall`.
    #[arg(long, env = "DECODE_NODE_ATTENTION", default_value = "scout", value_parser = ["scout", "full", "hgca", "recall"])]
    pub attention: String,
    /// Tokens per KV block: the unit of sparse selection. Smaller blocks select more
    /// precisely at the same budget: on SmolLM2-135M at 7.8k tokens (budget 1024, sketch
    /// scorer, CPU) block 16 kept a KL divergence from full of 0.0049 where block 32 kept
    /// 0.0072 (top-1 agreement 0.969 and 0.980; each head its own budget: 0.0066 and 0.0104),
    /// for ~7% of decode speed and twice the digests.
    #[arg(long, env = "DECODE_NODE_BLOCK_SIZE", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub block_size: u32,
    /// Tokens attended per layer and KV head in sparse modes: on average over the layer's
    /// heads with `--budget-split layer` (the default), by each head with `head`.
    #[arg(long, env = "DECODE_NODE_BUDGET_TOKENS", default_value_t = 2048)]
    pub budget_tokens: u32,
    /// Device-resident blocks per layer and KV head in sparse modes (0 = twice the budget's:
    /// blocks dropped from the selection a few steps ago are often selected again, and a
    /// device that kept them need not send them to the CPU part. SmolLM2-135M at 7.8k tokens,
    /// budget 2048, real text: CPU share 0.106 where as many as the budget gave 0.297 and
    /// 1.5 times 0.152, with the same attention). Admission reserves them on the device for
    /// each request: at twice a 2048-token budget, Qwen3-14B takes 671 MB a request (the
    /// budget alone 335 MB; `full` at 64k, 10.7 GB). Where device memory bounds how many
    /// requests run, the budget's blocks (`--device-blocks` = budget / block size) admit twice
    /// as many. Where it holds every block of a request, the blocks still on the host go up
    /// at every step within `--recall-budget-mib` until none is left: no CPU part after that.
    #[arg(long, env = "DECODE_NODE_DEVICE_BLOCKS", default_value_t = 0)]
    pub device_blocks: u32,
    /// Device KV that no running request counts on, lent in `scout` and `recall` (`on`), past
    /// a reserve of one request's `--device-blocks` share (so the next request starts without
    /// a call-back). A request whose every block (prompt and the tokens it may generate) fits
    /// in what is spare takes room for all of them, the oldest first: its prompt goes up over
    /// its first steps (within `--recall-budget-mib`, the selected blocks first), and its CPU
    /// part is then empty, as in `full`, while it still attends only its budget. What is left
    /// is shared evenly as more device slots per layer and KV head among the others, which
    /// keep more of the blocks they attended on the device. On a GPU only. A waiting request
    /// that needs the room to start takes it back from the largest loans, as many slots as it
    /// needs (each keeps its most recently used blocks), so a loan never turns a request away.
    /// `off`: each request keeps `--device-blocks` per layer and KV head, whatever is free.
    #[arg(long, env = "DECODE_NODE_SPARE_DEVICE_KV", default_value = "on", value_parser = ["on", "off"])]
    pub spare_device_kv: String,
    /// Per-layer recall intervals from `bench recall-profile` (a JSON file); without it,
    /// recall is adaptive (`--recall-threshold`).
    #[arg(long, env = "DECODE_NODE_RECALL_PROFILE")]
    pub recall_profile: Option<std::path::PathBuf>,
    /// Turn off layer-ahead CPU pre-computation (`scout` ablation; `--layer-ahead off`).
    #[arg(long, env = "DECODE_NODE_NO_PRECOMPUTE")]
    pub no_precompute: bool,
    /// Layer-ahead prediction in `scout`: layer i + 1's blocks chosen from a predicted query
    /// while layer i attends, so host selection overlaps the device's work. `auto`: on with a
    /// GPU, off on `--device cpu`, where both parts run on the same cores and there is nothing
    /// to overlap (SmolLM2-135M, 7.8k tokens, budget 1024, 2 cores: 50.8 tokens/s with it,
    /// 57.0 without, and fewer of full attention's answers kept). `on` shows what a GPU
    /// node's prediction costs in accuracy (`bench fidelity`).
    #[arg(long, env = "DECODE_NODE_LAYER_AHEAD", default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub layer_ahead: String,
    /// Turn off periodic recall (`scout` ablation).
    #[arg(long, env = "DECODE_NODE_NO_RECALL")]
    pub no_recall: bool,
    /// Recall a layer's CPU blocks when its CPU share of selected tokens passes this.
    #[arg(long, env = "DECODE_NODE_RECALL_THRESHOLD", default_value_t = 0.12)]
    pub recall_threshold: f32,
    /// MiB one request may recall per decode step over all layers (0: no limit). Each layer
    /// gets its share and may save a few steps of it; blocks the CPU attended two steps in a
    /// row go first.
    #[arg(long, env = "DECODE_NODE_RECALL_BUDGET_MIB", default_value_t = 64)]
    pub recall_budget_mib: u64,
    /// Recall backoff: a layer that selected fewer than this share of its recalled blocks at
    /// its next step waits twice as long before recalling again (up to 64 steps), and half
    /// as long after a recall that paid off (0: recall whenever the threshold is passed).
    #[arg(long, env = "DECODE_NODE_RECALL_MIN_USED", default_value_t = 0.5)]
    pub recall_min_used: f32,
    /// Select and attend every layer with the real query: no layer-ahead prediction is made
    /// (nothing ahead would be used), so any budget equals a plain block top-k.
    #[arg(long, env = "DECODE_NODE_EXACT")]
    pub exact: bool,
    /// Accuracy guard (`scout`): a layer whose predicted query has a cosine below this with
    /// the real one redoes its selection (and a CPU part started ahead) with the real query
    /// (-1: never).
    #[arg(long, env = "DECODE_NODE_GUARD_MIN_COSINE", default_value_t = 0.95)]
    pub guard_min_cosine: f32,
    /// Accuracy guard (`scout`): the first N layers attend with the real query from the start
    /// (no layer-ahead), where a layer's input changes most and prediction is poor.
    #[arg(long, env = "DECODE_NODE_GUARD_REAL_QUERY_LAYERS", default_value_t = 3)]
    pub guard_real_query_layers: u32,
    /// Accuracy guard (`scout`): let an accepted prediction choose the device part's blocks
    /// too (the paper's behaviour). By default the device part takes the resident blocks
    /// that rank best by the real query, in the budget the layer-ahead CPU part leaves.
    #[arg(long, env = "DECODE_NODE_GUARD_PREDICTED_DEVICE")]
    pub guard_predicted_device: bool,
    /// Accuracy guard (`scout`): attend an accepted prediction's CPU part a layer ahead with
    /// the predicted query (the paper's behaviour). By default the prediction only chooses
    /// the blocks, and the CPU part is attended with the real query alongside the device
    /// part: on SmolLM2-135M the predicted query's CPU part cost 7 points of top-1 agreement
    /// with full where the predicted selection cost 1. Where a GPU scores the blocks it
    /// predicts only with this flag, the next layer's scores queued while the device waits for
    /// the CPU part (7.8k tokens, budget 1024: top-1 0.914 and KL 0.044 against the real
    /// query's 0.9805 and 0.0074).
    #[arg(long, env = "DECODE_NODE_GUARD_PREDICTED_CPU")]
    pub guard_predicted_cpu: bool,
    /// How a GQA group's query heads combine into one block score for selection: the `max`
    /// of their Quest bounds (a block one head needs is not outvoted), or their `sum`. Max
    /// kept more of full's answers on SmolLM2 at both block sizes measured.
    #[arg(long, env = "DECODE_NODE_GROUP_SCORE", default_value = "max", value_parser = ["sum", "max"])]
    pub group_score: String,
    /// Newest tokens always selected in sparse modes, besides the sink (whole blocks; at least
    /// the newest block). In `hgca` this is the dense window on the device (0: half the
    /// budget), and the top-k gets the rest of the budget. A smaller window keeps more of
    /// full's answers and puts more of the step on the CPU: on SmolLM2-135M, a quarter of the
    /// budget kept every generated token of 10 passkey prompts at 3.8k tokens (budget 512;
    /// half: 0.975) and KL 0.0080 at 7.8k (budget 1024; half: 0.0093), with a CPU share of
    /// 0.71-0.73 of attended blocks where half gives 0.45-0.47.
    #[arg(long, env = "DECODE_NODE_LOCAL_WINDOW", default_value_t = 0)]
    pub local_window: u32,
    /// Each block chosen by score in sparse modes brings the block after it, at the same
    /// budget: a number or name that crosses a block boundary stays whole, in fewer places.
    #[arg(long, env = "DECODE_NODE_SELECT_SPANS")]
    pub select_spans: bool,
    /// How sparse modes spend the budget over a layer's KV heads. `layer`: the heads share
    /// the layer's (`--budget-tokens` times the KV heads); past each head's sink and window
    /// go the blocks with the largest share of their head's attention, whichever head they
    /// belong to, so a head whose attention is spread takes more blocks than one whose
    /// attention is concentrated (Ada-KV's allocation). On SmolLM2-135M at 7.8k tokens and
    /// budget 1024 (teacher-forced, scout) it kept top-1 agreement with full 0.980 (KL
    /// 0.0072) where `head` kept 0.957 (KL 0.0104). `head`: each head its own budget; also
    /// what `--block-scorer quest` gets, whose bounds are not shares comparable across heads.
    #[arg(long, env = "DECODE_NODE_BUDGET_SPLIT", default_value = "layer", value_parser = ["layer", "head"])]
    pub budget_split: String,
    /// The first N layers attend every block in sparse modes (their attention is broad; a
    /// top-k there loses most). The blocks beyond the device's go to the CPU part.
    #[arg(long, env = "DECODE_NODE_DENSE_LAYERS", default_value_t = 0)]
    pub dense_layers: u32,
    /// How sparse modes rank blocks: `quest` by the digests' upper bound on q·k (reads no
    /// KV); `sparq` re-ranks the bound's best blocks (`--scorer-candidates` times the budget)
    /// by their share of an approximate attention over every key of those blocks, computed on
    /// each query head's largest channels (`--scorer-channels`) read from host KV. On
    /// SmolLM2-135M (3.8k tokens, budget 512) sparq keeps top-1 agreement with full 0.83
    /// where quest keeps 0.62, and costs 15-25% of CPU decode speed there. `sketch` scores
    /// every block by an approximate attention over every key quantized to 4 bits (0.84 at
    /// 3.8k, KL 0.057 against sparq's 0.093; at 7.8k, budget 1024, KL 0.010 against 0.022):
    /// a GPU keeps that sketch (an eighth of a 16-bit KV cache) and scores on the device,
    /// reading no host KV, and then makes no layer-ahead prediction; a CPU node keeps it in
    /// host pool blocks (admission counts them with the request's growth), quantized once as
    /// blocks fill, and scores it with AVX2 (on SmolLM2 at 7.8k as fast as sparq). `auto`:
    /// sketch, except sparq on a GPU whose kernels do not take the head shape.
    #[arg(long, env = "DECODE_NODE_BLOCK_SCORER", default_value = "auto", value_parser = ["auto", "quest", "sparq", "sketch"])]
    pub block_scorer: String,
    /// Key channels per query head that `--block-scorer sparq` reads (0: a quarter of the
    /// head dimension). The whole head dimension with `--scorer-candidates 0` ranks blocks by
    /// their exact share of attention, reading every key: a ceiling for block scorers at a
    /// budget (`bench fidelity`; on SmolLM2-135M at 7.8k tokens, budget 1024, 40 passkey
    /// prompts, its generated tokens equalled full's as often as `sketch`'s did: 0.969).
    #[arg(long, env = "DECODE_NODE_SCORER_CHANNELS", default_value_t = 0)]
    pub scorer_channels: u32,
    /// Blocks `--block-scorer sparq` scores, as a multiple of the budget: the best by the
    /// digests' bound (0: every block). Keeps the keys read per step bounded by the budget
    /// rather than the context.
    #[arg(long, env = "DECODE_NODE_SCORER_CANDIDATES", default_value_t = 4)]
    pub scorer_candidates: u32,
    /// Turn the accuracy guard off (the paper's behaviour: every prediction is used).
    #[arg(long, env = "DECODE_NODE_NO_GUARD")]
    pub no_guard: bool,
    /// Host KV storage type: `auto` (the model's dtype), `f32`, `f16`, `bf16`, `int8` or `fp8`
    /// (e4m3). The last two store each token's K and V vector per head in 8 bits with its own
    /// f32 scale: about half of f16's bytes, so twice the context per byte of host memory (and
    /// of device memory: the CUDA backend copies and attends them as stored); attended on every
    /// CPU kernel path: AVX2, AVX-512, NEON, portable).
    /// Pushes still send f32, f16 or bf16 (`ModelInfo.kv_dtype`).
    #[arg(long, env = "DECODE_NODE_KV_DTYPE", default_value = "auto")]
    pub kv_dtype: String,
}

/// `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The name routers and dashboards know the model by, exported as the
    /// `served_model_name` label of `decode_node_model_info` (default: the model's id).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// gRPC listen address (KvTransfer, Decode, health, reflection).
    #[arg(long, env = "DECODE_NODE_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
    /// HTTP listen address for `/metrics`, `/live` and `/health`.
    #[arg(
        long,
        env = "DECODE_NODE_METRICS_ADDR",
        default_value = "127.0.0.1:9091"
    )]
    pub metrics_addr: SocketAddr,
    /// Host DRAM reserved for the KV pool (bytes; suffixes K, M, G, Ki, Mi, Gi).
    #[arg(long, env = "DECODE_NODE_HOST_KV_BYTES", default_value = "1Gi", value_parser = parse_bytes)]
    pub host_kv_bytes: u64,
    /// Make the whole host pool resident at start-up (no page faults during ingest).
    #[arg(long, env = "DECODE_NODE_HOST_KV_PREFAULT")]
    pub host_kv_prefault: bool,
    /// Host KV a finished request leaves behind for the next turn of its conversation
    /// (bytes, suffixes as above; 0: no prefix cache). Whole blocks of its prompt and
    /// generated tokens stay in the pool; a push with `reuse_prefix` then sends only what the
    /// node does not hold. Least recently used blocks go first, and any the pool needs for
    /// admission: a cached block never causes a refusal.
    #[arg(long, env = "DECODE_NODE_PREFIX_CACHE_BYTES", default_value = "0", value_parser = parse_bytes)]
    pub prefix_cache_bytes: u64,
    /// Device memory for resident KV blocks (bytes; suffixes as above). `auto`: on a GPU, its
    /// free memory once the model is loaded, less 1 GiB left for scratch; on the CPU, no
    /// limit (there is no device memory: both parts of attention read the host pool, and
    /// GetLoad reports a device capacity of 0). Where a GPU has less free memory than a figure
    /// given, the arena and admission take what it has. What running requests do not count on
    /// is lent (`--spare-device-kv`).
    #[arg(long, env = "DECODE_NODE_DEVICE_KV_BYTES", default_value = "auto", value_parser = parse_device_kv_bytes)]
    pub device_kv_bytes: u64,
    /// Seconds committed KV waits for its Generate before it is freed.
    #[arg(long, env = "DECODE_NODE_KV_LEASE", default_value_t = 60.0)]
    pub kv_lease: f64,
    /// Seconds a push may go without a message (its header included) before it is ended
    /// DEADLINE_EXCEEDED and everything it holds is freed.
    #[arg(long, env = "DECODE_NODE_PUSH_IDLE_TIMEOUT", default_value_t = 10.0, value_parser = parse_seconds)]
    pub push_idle_timeout: f64,
    /// Seconds a whole push may take from its stream's start to its commit.
    #[arg(long, env = "DECODE_NODE_PUSH_DEADLINE", default_value_t = 300.0, value_parser = parse_seconds)]
    pub push_deadline: f64,
    /// Pushes in flight at once; one more is refused RESOURCE_EXHAUSTED. Push buffers hold at
    /// most this many times (--max-push-message + the 16 MiB HTTP/2 stream window).
    #[arg(long, env = "DECODE_NODE_MAX_PUSH_STREAMS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_push_streams: u32,
    /// Largest gRPC message of a push (a KvChunk; bytes, suffixes as above): what one push
    /// stream may make the node buffer besides its HTTP/2 window.
    #[arg(long, env = "DECODE_NODE_MAX_PUSH_MESSAGE", default_value = "64Mi", value_parser = parse_bytes)]
    pub max_push_message: u64,
    /// Requests decoded together at most.
    #[arg(long, env = "DECODE_NODE_MAX_BATCH", default_value_t = 64)]
    pub max_batch: u32,
    /// Threads of the CPU-attention pool (the CPU part of sparse attention). 0: on `--device
    /// cpu`, every core, as the whole step runs in this pool; on a GPU whose key sketch scores
    /// the blocks (the default scorer there), every core but two, as the CPU part then decides
    /// scout's speed; where the host scores blocks (`--block-scorer sparq|quest`, on rayon's
    /// global pool, every core), a quarter of the cores, at least one.
    #[arg(long, env = "DECODE_NODE_CPU_ATTENTION_THREADS", default_value_t = 0)]
    pub cpu_attention_threads: usize,
    /// Seconds to finish running requests after SIGTERM before exiting.
    #[arg(long, env = "DECODE_NODE_DRAIN_TIMEOUT", default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// Generate, Cancel and DropKv must present the lease their push was given
    /// (PushKvResponse.lease, passed on by the orchestrator); otherwise PERMISSION_DENIED.
    #[arg(long, env = "DECODE_NODE_REQUIRE_LEASE")]
    pub require_lease: bool,
    /// File of bearer tokens every RPC but health must carry: one per line, `TOKEN` (every
    /// role) or `TOKEN ROLE[,ROLE]` with roles `push` (KvTransfer), `generate` (Decode) and
    /// `admin` (both); `#` starts a comment.
    #[arg(long, env = "DECODE_NODE_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// TLS certificate chain (PEM).
    #[arg(long, env = "DECODE_NODE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, env = "DECODE_NODE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Seconds a TLS client may take to finish its handshake before the connection is closed.
    #[arg(long, env = "DECODE_NODE_TLS_HANDSHAKE_TIMEOUT", default_value_t = 10.0, value_parser = parse_seconds)]
    pub tls_handshake_timeout: f64,
    /// CA (PEM) whose client certificates are required (mTLS).
    #[arg(long, env = "DECODE_NODE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

/// `prefill`.
#[derive(Debug, Clone, Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Decode node to push to, e.g. `http://127.0.0.1:50051`.
    #[arg(long, env = "DECODE_NODE_TARGET")]
    pub target: String,
    /// Prompt text.
    #[arg(long, conflicts_with = "prompt_tokens")]
    pub prompt: Option<String>,
    /// Instead of text, a synthetic prompt of this many tokens.
    #[arg(long)]
    pub prompt_tokens: Option<u32>,
    /// Request id (a random one is made when absent).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Ask the node to reuse what its prefix cache holds of the prompt's start (an earlier
    /// turn of the conversation): only the tokens after those are sent.
    #[arg(long)]
    pub reuse_prefix: bool,
    /// File holding the bearer token.
    #[arg(long, env = "DECODE_NODE_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
}

/// How `prefill` and `generate` reach a node that serves TLS (`serve --tls-cert`): an
/// `https://` target and the CA that signed the node's certificate.
#[derive(Debug, Clone, Default, Args)]
pub struct ClientTlsArgs {
    /// CA certificate (PEM) that signed the node's certificate; needed for an `https://`
    /// target.
    #[arg(long)]
    pub tls_ca_cert: Option<PathBuf>,
    /// This client's certificate (PEM), for a node that requires one (`serve
    /// --tls-client-ca`); with `--tls-client-key`.
    #[arg(long, requires = "tls_client_key")]
    pub tls_client_cert: Option<PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, requires = "tls_client_cert")]
    pub tls_client_key: Option<PathBuf>,
    /// Name to verify the node's certificate against (default: the target's host).
    #[arg(long)]
    pub tls_domain: Option<String>,
}

/// `generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// Decode node, e.g. `http://127.0.0.1:50051`.
    #[arg(long, env = "DECODE_NODE_TARGET")]
    pub target: String,
    /// Request whose KV was (or will be) pushed.
    #[arg(long)]
    pub request_id: String,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (0 or 1 = off).
    #[arg(long, default_value_t = 0.0)]
    pub top_p: f32,
    /// Top-k sampling (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep going past EOS.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Repetition penalty over the prompt and output (transformers' and vLLM's; 0 or 1 = off).
    #[arg(long, default_value_t = 0.0)]
    pub repetition_penalty: f32,
    /// Presence penalty over the output, in [-2, 2] (OpenAI's).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Frequency penalty over the output, in [-2, 2] (OpenAI's).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// No EOS, stop id or stop string before this many tokens.
    #[arg(long, default_value_t = 0)]
    pub min_tokens: u32,
    /// A stop string, taken whole (repeat the flag for several): the text ends before the
    /// first one.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Milliseconds to wait for the KV push (0 = server default).
    #[arg(long, default_value_t = 0)]
    pub kv_timeout_ms: u32,
    /// The push's lease (logged by `prefill`); required when the node runs --require-lease.
    #[arg(long)]
    pub lease: Option<String>,
    /// Print token ids, not text.
    #[arg(long)]
    pub ids: bool,
    /// File holding the bearer token.
    #[arg(long, env = "DECODE_NODE_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: ClientTlsArgs,
}

/// `demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text.
    #[arg(
        long,
        default_value = "The decode node streams tokens while the prefill node"
    )]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 48)]
    pub max_new_tokens: u32,
}

/// `selftest`.
#[derive(Debug, Clone, Args)]
pub struct SelftestArgs {
    /// Model, device (`--device cuda[:N]`) and attention settings of the end-to-end decodes.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens of the end-to-end decodes (random ids, fixed seed).
    #[arg(long, default_value_t = 700)]
    pub prompt_tokens: usize,
    /// Tokens each end-to-end decode generates.
    #[arg(long, default_value_t = 32)]
    pub tokens: u32,
}

/// `bench`: one subcommand per bench, each with its own flags.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The bench to run.
    #[command(subcommand)]
    pub bench: Bench,
}

/// The benches. Each prints its figures as ratios against a bound measured in the same run.
#[derive(Debug, Clone, Subcommand)]
pub enum Bench {
    /// Sparse attention kernels against this machine's memory bandwidth, per thread count
    /// (f16 and bf16 KV, or the one `--kv-dtype` names). Each row's roofline is the lower of
    /// the read bandwidth and the FMA rate; its ratio is given best pass over best probe, and
    /// paired: where reads bound it, the median over rounds that read the same bytes just
    /// before attending them (steadier on a shared host, whose bandwidth moves between
    /// probes).
    Kernels(KernelsBench),
    /// Loopback PushKv throughput against memcpy, one or several concurrent pushes.
    Ingest(IngestBench),
    /// Tokens/s and TTFT of each attention mode at each context length, through `serve`; on
    /// the CPU with the bytes a step moves against read bandwidth, and the ratio to a roofline
    /// (those bytes at read bandwidth, or the step's FMAs at the FMA rate measured in the same
    /// run, whichever is slower: batches of a few rows are bound by the FMAs).
    Decode(DecodeBench),
    /// How many requests of one context length each mode serves at once on this node's
    /// device and host KV memory, and their aggregate tokens/s, through `serve`.
    Capacity(CapacityBench),
    /// One batched decode step's dense work (projections, norms, MLP; attention reduced to
    /// the token itself) against the weights' memory-bandwidth bound, in process.
    Step(StepBench),
    /// Each layer's CPU share over a decode, to write a recall profile for `--recall-profile`.
    RecallProfile(RecallProfileBench),
    /// Pushers and generators at a fixed rate with a fault injected every second; the pool
    /// must come back to its start byte for byte, RSS is reported.
    Soak(SoakBench),
    /// A chat workload over several turns, pushed with and without prefix reuse: bytes pushed
    /// and time to first token of each.
    Multiturn(MultiturnBench),
    /// Accuracy of each mode and budget against `full` on a real model: passkey retrieval
    /// and teacher-forced agreement on real text, with speed.
    Fidelity(FidelityBench),
    /// Host block selection (every sparse mode's per-layer scoring and top-k) against the
    /// read bandwidth of the same threads, per scorer, context and thread count, in process.
    Select(SelectBench),
}

/// Flags every bench has.
#[derive(Debug, Clone, Args)]
pub struct BenchCommon {
    /// Print JSON only (no table on stderr).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// `bench kernels`.
#[derive(Debug, Clone, Args)]
pub struct KernelsBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// Seconds to spend per measurement (0: one pass).
    #[arg(long, default_value_t = 1.0, value_parser = parse_bench_seconds)]
    pub seconds: f64,
    /// Thread counts to measure, e.g. `1,2`.
    #[arg(long, default_value = "1,2")]
    pub threads: String,
    /// Query heads per KV head (GQA group sizes) to measure.
    #[arg(long, default_value = "1,4,5,8")]
    pub groups: String,
    /// Head dims to measure.
    #[arg(long, default_value = "64,128")]
    pub head_dims: String,
    /// KV bytes scanned, in MiB: well above the last-level cache measures memory; one that
    /// fits the threads' L2 (e.g. 1) measures the kernel's own speed, with no memory stream
    /// to overlap (a small set is scanned again, at least 32 MiB a thread per timed pass).
    /// 0: four times this CPU's last-level cache, at least 256.
    #[arg(long, default_value_t = 0)]
    pub working_set_mib: usize,
    /// Kernel paths: `best` (what the node runs on this CPU), `scalar` (the portable path,
    /// which is what a CPU with no SIMD path of ours gets, e.g. arm64), `avx2` (AVX2 only, as
    /// on a CPU without AVX-512), `avx512`, `avx512bf16` (`avx512` with bf16 blocks of groups
    /// of 5 to 8 multiplied in bf16 pairs, held to that instruction's product rate), `amx`
    /// (`avx512` with bf16 blocks of groups of 4 to 8, 7 and 8 above head dim 64, and int8 and
    /// fp8 blocks of groups of 6 to 8, multiplied by AMX tiles, held to their product rate); a
    /// path this CPU lacks is skipped.
    #[arg(long, default_value = "best")]
    pub paths: String,
    /// With `--device cuda`: tokens per KV head each timed call attends, every block of them
    /// (what `full` reads per layer), e.g. `8k,64k`.
    #[arg(long, default_value = "8k,64k")]
    pub context: String,
    /// With `--device cuda`: KV heads per call (Qwen3-14B's 8 by default).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// With `--device cuda`: CUDA blocks the split-K launch aims for, a list to sweep (0: the
    /// node's setting, `DECODE_NODE_ATTENTION_CTAS` or its default).
    #[arg(long, default_value = "0")]
    pub ctas: String,
}

/// `bench select`. The budget, scorer channels and candidates, group score, block size and
/// KV dtype come from the usual model flags.
#[derive(Debug, Clone, Args)]
pub struct SelectBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// Seconds to spend per measurement (0: one pass).
    #[arg(long, default_value_t = 1.0, value_parser = parse_bench_seconds)]
    pub seconds: f64,
    /// Context lengths, e.g. `8k,32k`.
    #[arg(long, default_value = "8k,32k")]
    pub context: String,
    /// Thread counts of the pool selection runs on, e.g. `1,2`.
    #[arg(long, default_value = "1,2")]
    pub threads: String,
    /// Block scorers to measure: `quest` (digests only), `sparq` (re-ranks the best
    /// candidates by an approximate attention over key rows read from host KV) and/or
    /// `sketch` (every key, quantized to 4 bits as read: the CPU path of a GPU's scorer),
    /// `device`: the host's part where a GPU scored every block (each head's top-k and
    /// residency plan, on the step thread), and `device-picks`: where the GPU also picked the
    /// blocks (`top_blocks`; the residency plan alone).
    #[arg(long, default_value = "quest,sparq")]
    pub scorers: String,
    /// KV heads per layer (the default is Qwen3-14B's shape: 8 KV heads, groups of 5, head
    /// dim 128).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Query heads per KV head.
    #[arg(long, default_value_t = 5)]
    pub group: usize,
    /// Head dim.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Layers of KV held and selected in turn, so digests and keys come from memory, not
    /// cache, as over a model's layers (0: per context, enough layers that their digests and
    /// sketches are twice the last-level cache, 4 to 64, at most 4 GiB of KV).
    #[arg(long, default_value_t = 0)]
    pub layers: usize,
}

/// `bench ingest`.
#[derive(Debug, Clone, Args)]
pub struct IngestBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// GiB to push.
    #[arg(long, default_value_t = 1.0)]
    pub gib: f64,
    /// Concurrent pushes, as from several prefill nodes (each its own request).
    #[arg(long, default_value_t = 1)]
    pub streams: u32,
}

/// `bench decode`.
#[derive(Debug, Clone, Args)]
pub struct DecodeBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// Context lengths, e.g. `8k,32k`.
    #[arg(long, default_value = "2k")]
    pub context: String,
    /// Attention modes, compared in one run.
    #[arg(long, default_value = "full,hgca,recall,scout")]
    pub modes: String,
    /// Concurrent requests. Above 1, each round first decodes one request alone on the same
    /// node, and the row reports the batch's speedup over it (the median of the rounds').
    #[arg(long, default_value_t = 1)]
    pub batch: u32,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    pub tokens: u32,
    /// Rounds per mode: each pushes the batch again, decodes it and then measures the bound
    /// (read bandwidth on the CPU), so each round's rate is divided by the probes just before
    /// and after it. The row is the middle round by that ratio, and every round is listed.
    /// On a shared VM bandwidth moves by a third over minutes (a 2-core EPYC: best read pass
    /// 32-46 GB/s across runs), so one round's ratio says little on its own.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Threads of the node's CPU-attention pool (0: `serve`'s default; see its
    /// `--cpu-attention-threads`).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub cpu_attention_threads: u32,
}

/// `bench capacity`.
#[derive(Debug, Clone, Args)]
pub struct CapacityBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// Context length of every request, e.g. `8k`, `64k`.
    #[arg(long, default_value = "8k")]
    pub context: String,
    /// Attention modes, compared in one run (ratios to `full` when it comes first).
    #[arg(long, default_value = "full,hgca,scout")]
    pub modes: String,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    pub tokens: u32,
    /// Host DRAM for the KV pool: what bounds the sparse modes, which keep all KV there.
    #[arg(long, default_value = "4Gi", value_parser = parse_bytes)]
    pub host_kv_bytes: u64,
    /// Device memory for KV: what bounds `full`, which keeps every block of every request
    /// there (the sparse modes keep their resident blocks: `--device-blocks` or the budget).
    #[arg(long, default_value = "1Gi", value_parser = parse_bytes)]
    pub device_kv_bytes: u64,
    /// Most requests tried per mode (also the node's batch limit).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_requests: u32,
    /// Threads of the node's CPU-attention pool (0: `serve`'s default; see its
    /// `--cpu-attention-threads`).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub cpu_attention_threads: u32,
}

/// `bench step`.
#[derive(Debug, Clone, Args)]
pub struct StepBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// Requests in the batch (batch 1 is always measured too).
    #[arg(long, default_value_t = 1)]
    pub batch: u32,
    /// Seconds to spend measuring (0: one step).
    #[arg(long, default_value_t = 1.0, value_parser = parse_bench_seconds)]
    pub seconds: f64,
}

/// `bench recall-profile`.
#[derive(Debug, Clone, Args)]
pub struct RecallProfileBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// Context length, e.g. `2k`.
    #[arg(long, default_value = "2k")]
    pub context: String,
    /// Decode steps profiled.
    #[arg(long, default_value_t = 32)]
    pub tokens: u32,
}

/// `bench soak`.
#[derive(Debug, Clone, Args)]
pub struct SoakBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// How long it runs (e.g. `10m`, `90s`).
    #[arg(long, default_value = "60s")]
    pub duration: String,
    /// Requests started per second.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
}

/// `bench multiturn`.
#[derive(Debug, Clone, Args)]
pub struct MultiturnBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// Conversations, interleaved turn by turn.
    #[arg(long, default_value_t = 2)]
    pub conversations: u32,
    /// Turns of each conversation.
    #[arg(long, default_value_t = 6)]
    pub turns: u32,
    /// Tokens of the first prompt (system prompt and first message).
    #[arg(long, default_value_t = 512)]
    pub first_tokens: u32,
    /// Tokens of each later user message.
    #[arg(long, default_value_t = 64)]
    pub user_tokens: u32,
    /// Tokens of each reply.
    #[arg(long, default_value_t = 32)]
    pub reply_tokens: u32,
    /// The node's host KV pool (also its prefix cache's limit in the run with reuse).
    #[arg(long, default_value = "1Gi", value_parser = parse_bytes)]
    pub host_kv_bytes: u64,
}

/// `bench fidelity`.
#[derive(Debug, Clone, Args)]
pub struct FidelityBench {
    #[command(flatten)]
    pub common: BenchCommon,
    /// Passkey context lengths, e.g. `2k,3800`.
    #[arg(long, default_value = "2k")]
    pub context: String,
    /// Attention modes compared against `full`.
    #[arg(long, default_value = "full,hgca,recall,scout")]
    pub modes: String,
    /// Budgets (tokens per layer and KV head), e.g. `256,512,1024`.
    #[arg(long, default_value = "512")]
    pub budgets: String,
    /// Passkey prompts per context length (fixed seeds, spread in depth).
    #[arg(long, default_value_t = 5)]
    pub prompts: usize,
    /// Teacher-forced positions on real text.
    #[arg(long, default_value_t = 256)]
    pub forced: usize,
    /// Accuracy guard for `scout`: `on`, `off` or `both` (compared).
    #[arg(long, default_value = "both", value_parser = ["on", "off", "both"])]
    pub guard: String,
    /// Host KV dtypes compared, e.g. `f32,f16,bf16,int8,fp8`: every case runs on a pool of each,
    /// fed the same prefill (sent as f32, converted on ingest), and is measured against `full`
    /// on the first one listed. Without it, the pool is `--kv-dtype`'s.
    #[arg(long)]
    pub kv_dtypes: Option<String>,
    /// CPU attention kernel paths compared, e.g. `avx512,avx512bf16` (names as in `bench kernels
    /// --paths`; `best`: the one each call would take): every case runs on each, measured
    /// against `full` on the first one listed. `DECODE_NODE_BF16_DOT=all` gives `avx512bf16`
    /// groups of 2 to 8, and `DECODE_NODE_AMX=all` does so for `amx`, to measure their
    /// rounding on a model with small groups.
    #[arg(long)]
    pub cpu_paths: Option<String>,
    /// Print each passkey answer.
    #[arg(long)]
    pub verbose: bool,
}

/// `make-model`.
#[derive(Debug, Clone, Args)]
pub struct MakeModelArgs {
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Architecture family.
    #[arg(long, default_value = "llama", value_parser = ["llama", "qwen2", "qwen3", "mistral"])]
    pub arch: String,
    /// Named geometry: `tiny`, `small`, `qwen3-8b`, `qwen3-14b`, `llama3-8b`; flags override it.
    #[arg(long)]
    pub preset: Option<String>,
    /// Hidden size.
    #[arg(long)]
    pub hidden_size: Option<usize>,
    /// MLP intermediate size.
    #[arg(long)]
    pub intermediate_size: Option<usize>,
    /// Layers.
    #[arg(long)]
    pub num_layers: Option<usize>,
    /// Query heads.
    #[arg(long)]
    pub num_heads: Option<usize>,
    /// KV heads (GQA when fewer than query heads).
    #[arg(long)]
    pub num_kv_heads: Option<usize>,
    /// Head dimension (default hidden / heads).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Vocabulary size.
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Tie the LM head to the embeddings.
    #[arg(long)]
    pub tie_word_embeddings: Option<bool>,
    /// RoPE base.
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// Weight dtype: f32, f16, bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Parses a positive duration in seconds (at most a day).
pub fn parse_seconds(s: &str) -> Result<f64, String> {
    parse_seconds_in(s, 0.0, false, 86_400.0)
}

/// Parses a bench's measuring time in seconds, 0 to an hour (0: one pass).
pub fn parse_bench_seconds(s: &str) -> Result<f64, String> {
    parse_seconds_in(s, 0.0, true, 3600.0)
}

/// Seconds from `lo` (included when `lo_in`) to `hi`; NaN is outside every range.
fn parse_seconds_in(s: &str, lo: f64, lo_in: bool, hi: f64) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("{s:?} is not a number of seconds: {e}"))?;
    let above_lo = if lo_in { v >= lo } else { v > lo };
    if !(above_lo && v <= hi) {
        let open = if lo_in { '[' } else { '(' };
        return Err(format!("{s} s is outside {open}{lo}, {hi}]"));
    }
    Ok(v)
}

/// Parses a byte count with an optional K/M/G (decimal) or Ki/Mi/Gi (binary) suffix.
/// `--device-kv-bytes`: a byte count, or `auto` ([`DEVICE_KV_AUTO`]).
pub fn parse_device_kv_bytes(s: &str) -> Result<u64, String> {
    match s.trim() {
        "auto" => Ok(DEVICE_KV_AUTO),
        s => parse_bytes(s),
    }
}

/// `--device-kv-bytes auto`: as much as the device has (a GPU's arena is capped by its free
/// memory; the CPU has no device memory to count).
pub const DEVICE_KV_AUTO: u64 = u64::MAX;

pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("not a byte count: {s:?}"))?;
    let mult: f64 = match unit.trim().trim_end_matches(['B', 'b']) {
        "" => 1.0,
        "K" | "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0f64.powi(4),
        u => return Err(format!("unknown byte unit {u:?} in {s:?}")),
    };
    if n.is_nan() || n < 0.0 || !(n * mult).is_finite() {
        return Err(format!("not a byte count: {s:?}"));
    }
    Ok((n * mult) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_consistent() {
        command().debug_assert();
    }

    /// Every flag of every subcommand, with its path (`bench decode --tokens`).
    fn flags(cmd: &clap::Command, path: &str, out: &mut Vec<(String, clap::Arg)>) {
        for a in cmd.get_arguments() {
            if a.get_long().is_some() {
                out.push((path.to_owned(), a.clone()));
            }
        }
        for sub in cmd.get_subcommands() {
            flags(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    #[test]
    fn every_flag_reads_its_environment_variable() {
        let mut cmd = command();
        cmd.build();
        let mut all = Vec::new();
        flags(&cmd, "decode-node", &mut all);
        assert!(all.len() > 100, "only {} flags found", all.len());
        let mut missing = Vec::new();
        for (path, a) in &all {
            let long = a.get_long().unwrap_or_default();
            if matches!(long, "help" | "version") {
                continue;
            }
            let want = env_name(long);
            if a.get_env().and_then(|e| e.to_str()) != Some(want.as_str()) {
                missing.push(format!("{path} --{long}: {:?}, want {want}", a.get_env()));
            }
        }
        assert!(
            missing.is_empty(),
            "flags without their variable:\n{}",
            missing.join("\n")
        );
    }

    #[test]
    fn switches_take_the_usual_spellings_from_the_environment() {
        for (value, want) in [("1", true), ("yes", true), ("true", true), ("on", true)]
            .into_iter()
            .chain([
                ("0", false),
                ("no", false),
                ("false", false),
                ("off", false),
            ])
        {
            // The process environment is shared by the tests: a name of this test's own
            // stands in for DECODE_NODE_EXACT.
            // SAFETY: no other test reads or writes this variable.
            unsafe { std::env::set_var("DECODE_NODE_TEST_SWITCH", value) };
            let m = command()
                .mut_subcommand("serve", |s| {
                    s.mut_arg("exact", |a| a.env("DECODE_NODE_TEST_SWITCH"))
                })
                .try_get_matches_from(["decode-node", "serve"])
                .unwrap_or_else(|e| panic!("DECODE_NODE_TEST_SWITCH={value}: {e}"));
            let cli = Cli::from_arg_matches(&m).unwrap();
            let Command::Serve(a) = cli.command else {
                panic!("not serve")
            };
            assert_eq!(a.model.exact, want, "{value}");
        }
        // SAFETY: as above.
        unsafe { std::env::remove_var("DECODE_NODE_TEST_SWITCH") };
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("1Gi"), Ok(1 << 30));
        assert_eq!(parse_device_kv_bytes("auto"), Ok(DEVICE_KV_AUTO));
        assert_eq!(parse_device_kv_bytes("40Gi"), Ok(40 << 30));
        assert!(parse_device_kv_bytes("most").is_err());
        assert_eq!(parse_bytes("256Mi"), Ok(256 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1").is_err());
        assert!(parse_bytes("1Q").is_err());
    }

    /// A bench's `--seconds` outside [0, 3600] (NaN, negative, infinite) is refused at parse
    /// time: `bench kernels --seconds NaN` used to panic building a `Duration`.
    #[test]
    fn bench_seconds() {
        assert_eq!(parse_bench_seconds("0"), Ok(0.0));
        assert_eq!(parse_bench_seconds("0.5"), Ok(0.5));
        for bad in ["NaN", "-1", "inf", "3601", "soon"] {
            assert!(parse_bench_seconds(bad).is_err(), "{bad}");
        }
        // Timeouts exclude 0 and stop at a day.
        assert_eq!(parse_seconds("86400"), Ok(86_400.0));
        for bad in ["0", "NaN", "-1", "86401"] {
            let err = parse_seconds(bad).unwrap_err();
            assert!(err.contains("(0, 86400]"), "{bad}: {err}");
        }
        for sub in ["kernels", "select", "step"] {
            let err =
                Cli::try_parse_from(["decode-node", "bench", sub, "--seconds", "NaN"]).unwrap_err();
            assert!(
                err.to_string().contains("outside [0, 3600]"),
                "{sub}: {err}"
            );
        }
    }
}
