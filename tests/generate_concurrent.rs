//! 32 concurrent requests with mixed prompt and output lengths all finish with the right
//! token counts (CPU parts spread over a 3-thread CPU-attention pool), and the pool returns
//! to empty.

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_mixed_requests_finish_with_exact_counts() {
    let s = Served::start(&[
        "--max-batch",
        "16",
        "--block-size",
        "16",
        "--budget-tokens",
        "64",
        "--cpu-attention-threads",
        "3",
    ]);
    let started = s.log.lock().unwrap().join("\n");
    assert!(
        started
            .lines()
            .any(|l| l.contains("CPU-attention pool") && l.contains("\"threads\":3")),
        "{started}"
    );
    let s = &s;
    let jobs = (0..32u64).map(|i| async move {
        let id = format!("c{i}");
        let p = prompt(5 + (i as usize * 37) % 150, i);
        let want = 1 + (i as u32 * 7) % 30;
        // Half push first, half generate first.
        let kv = prompt_kv(&id, &p);
        let (g, pushed) = if i % 2 == 0 {
            let pushed = push(s, &kv).await;
            (generate(s, gen_req(&id, want)).await, pushed)
        } else {
            tokio::join!(generate(s, gen_req(&id, want)), push(s, &kv))
        };
        pushed.unwrap();
        let (ids, fin) = g.unwrap();
        assert_eq!(ids.len() as u32, want, "request {id}");
        assert_eq!(fin.generated_tokens, want);
    });
    futures_join_all(jobs).await;
    let l = wait_load(s, |l| l.host_kv_bytes_used == 0 && l.running == 0).await;
    assert_eq!((l.host_kv_bytes_used, l.running, l.waiting), (0, 0, 0));
    let m = s.metrics_text();
    assert!(
        m.contains("decode_node_requests_total{outcome=\"length\"} 32"),
        "{m}"
    );
}

async fn futures_join_all<F: std::future::Future<Output = ()> + Send>(fs: impl Iterator<Item = F>) {
    let mut set = Vec::new();
    for f in fs {
        set.push(f);
    }
    // Poll all together on this task: simple and enough for 32.
    let all = async {
        let mut pinned: Vec<_> = set.into_iter().map(Box::pin).collect();
        std::future::poll_fn(|cx| {
            pinned.retain_mut(|f| f.as_mut().poll(cx).is_pending());
            if pinned.is_empty() {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await
    };
    tokio::time::timeout(std::time::Duration::from_secs(120), all)
        .await
        .expect("all requests finish in time");
}
