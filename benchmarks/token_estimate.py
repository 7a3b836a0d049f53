"""How far the labelled token estimate is from exact tiktoken counts.

No Claude tokenizer is available offline, so the reference for every sample is
the larger of the exact cl100k_base and o200k_base counts. The corpus is
hand-written and deterministic: whole samples plus each of their lines, so
short texts (where relative error is largest) are measured too.

Run: ``.venv/bin/python -m benchmarks.token_estimate`` (prints a table, writes
``benchmarks/results/token_estimate.json``).
"""

from __future__ import annotations

import json
import platform
import random
import sys
import time
from pathlib import Path

from ibex.assembly.tokens import ESTIMATE_MAX_UNDERCOUNT, Tokenizers

RESULTS = Path(__file__).parent / "results" / "token_estimate.json"

_ENGLISH = [
    """The user prefers short answers in the morning and detailed explanations in the
evening. They work as a site reliability engineer at a logistics company and are
on call every third week. When they are on call, they want incident summaries to
lead with customer impact, then the timeline, then the suspected cause.""",
    """Our quarterly planning meeting moved from Tuesday to Thursday afternoon. Please
remind the team that the budget spreadsheet must be updated before the meeting,
and that anyone presenting should send their slides to Maria by Wednesday noon.""",
    """Photosynthesis converts light energy into chemical energy stored in glucose.
In the light-dependent reactions, water is split and oxygen is released; in the
Calvin cycle, carbon dioxide is fixed into three-carbon sugars that the plant
later assembles into starch, cellulose and sucrose.""",
    """It was a bright cold day in April, and the clocks were striking thirteen. The
hallway smelt of boiled cabbage and old rag mats. At one end of it a coloured
poster, too large for indoor display, had been tacked to the wall.""",
    """Don't schedule anything before 10am on Mondays; the user's kids have swimming
lessons. They're allergic to peanuts and shellfish, so restaurant suggestions
should avoid Thai and seafood places unless the menu clearly labels allergens.""",
    """The contract renewal is due on 2025-03-31. Legal asked for three changes:
liability capped at twelve months of fees, a 30-day termination-for-convenience
clause, and data residency in the EU (Frankfurt or Dublin regions only).""",
    """Remember: the staging database was migrated to PostgreSQL 16 last week, and the
connection string now uses the pgbouncer endpoint on port 6432. Long-running
analytics queries should go to the read replica instead of the primary.""",
    """Antidisestablishmentarianism, pneumonoultramicroscopicsilicovolcanoconiosis and
floccinaucinihilipilification are favourite examples of unusually long English
words; the user enjoys trivia like this and asked to hear one each Friday.""",
    """Customer feedback from the beta: onboarding took too long (median 14 minutes),
the export button was hard to find, and several people asked for dark mode.
Net promoter score rose from 31 to 42 after the March release.""",
    """I visited Kyoto, Osaka and Nara in the autumn. The maple leaves at Tofuku-ji
were spectacular, though crowded; next time I'd like to stay in a ryokan near
Arashiyama and take the early train to avoid the tour groups.""",
    """Q: What's the difference between a process and a thread?
A: A process has its own address space; threads share one. Switching between
threads is cheaper, but a crash in one thread can take down the whole process.""",
    """Meeting notes - 12/04: Attendees: J. Smith, K. O'Neil, R. Patel. Decisions:
(1) ship v2.3 behind a feature flag; (2) freeze the API until QA signs off;
(3) revisit pricing tiers in Q3. Action items: R.P. to draft the rollout plan.""",
    "OK",
    "Thanks!",
    "The user's name is Alex.",
    "Prefers metric units; lives in Toronto; birthday is June 4th.",
]

_CJK = [
    """用户喜欢在早上收到简短的回答，晚上则希望得到详细的解释。他们在一家物流公司担任
网站可靠性工程师，每三周值班一次。值班期间，他们希望事故摘要首先说明对客户的影响，
然后是时间线，最后是可能的原因。""",
    """光合作用将光能转化为储存在葡萄糖中的化学能。在光反应阶段，水被分解并释放氧气；
在卡尔文循环中，二氧化碳被固定为三碳糖，植物随后将其合成淀粉、纤维素和蔗糖。""",
    """我们的季度规划会议从周二改到了周四下午。请提醒团队在会议前更新预算表格，
并且所有演讲者都应在周三中午之前把幻灯片发给玛丽亚。""",
    """北京、上海、广州和深圳是中国的一线城市。春节期间，数以亿计的人返乡探亲，
铁路和航空的客流量达到全年最高峰。""",
    """ユーザーは朝は短い回答を好み、夜は詳しい説明を希望しています。物流会社で
サイト信頼性エンジニアとして働いており、三週間に一度オンコール当番があります。""",
    """秋に京都、大阪、奈良を訪れました。東福寺の紅葉は素晴らしかったですが、とても
混雑していました。次回は嵐山の近くの旅館に泊まりたいと思います。""",
    """吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗い
じめじめした所でニャーニャー泣いていた事だけは記憶している。""",
    """カタカナ語の例：コンピューター、インターネット、スマートフォン、アプリケーション、
データベース、クラウドサービス。""",
    """사용자는 아침에는 짧은 답변을, 저녁에는 자세한 설명을 선호합니다. 물류 회사에서
사이트 신뢰성 엔지니어로 일하고 있으며 3주마다 한 번씩 당직을 섭니다.""",
    """우리 분기 계획 회의가 화요일에서 목요일 오후로 옮겨졌습니다. 회의 전에 예산
스프레드시트를 업데이트해야 한다는 것을 팀에 상기시켜 주세요.""",
    """서울은 대한민국의 수도이며 인구는 약 천만 명입니다. 한강이 도시를 가로질러
흐르고, 북한산과 남산이 도시를 둘러싸고 있습니다.""",
    "你好",
    "ありがとうございます",
    "감사합니다",
    "用户的名字是王小明，住在杭州。",
    "東京都渋谷区神南1-2-3、電話03-1234-5678。",
]

_CODE = [
    '''def pack(candidates: list[Candidate], budget: int) -> list[Candidate]:
    """Greedy fallback: highest score first, skip what does not fit."""
    chosen, used = [], 0
    for c in sorted(candidates, key=lambda c: (-c.score, c.memory_id)):
        if used + c.tokens <= budget:
            chosen.append(c)
            used += c.tokens
    return chosen
''',
    """export async function fetchHot(agentId: string, limit = 20): Promise<Memory[]> {
  const url = `${BASE}/v1/memories/hot?agent_id=${encodeURIComponent(agentId)}&limit=${limit}`;
  const res = await fetch(url, { headers: { Authorization: `Bearer ${token}` } });
  if (!res.ok) throw new Error(`hot: HTTP ${res.status}`);
  return (await res.json()).data.results.map((r: any) => r.memory);
}
""",
    """func (s *Server) Assemble(ctx context.Context, req *pb.Request) (*pb.Response, error) {
	if req.GetAgentId() == "" {
		return nil, status.Error(codes.InvalidArgument, "agent_id is required")
	}
	ctx, cancel := context.WithTimeout(ctx, 45*time.Millisecond)
	defer cancel()
	return s.pipeline.Run(ctx, req)
}
""",
    """impl<T: Ord + Clone> BinaryHeap<T> {
    pub fn push_bounded(&mut self, item: T, cap: usize) {
        if self.len() < cap {
            self.push(item);
        } else if let Some(mut top) = self.peek_mut() {
            if item < *top { *top = item; }
        }
    }
}
""",
    """SELECT m.id, m.category, COUNT(f.id) AS feedback_count,
       AVG(CASE WHEN f.kind = 'positive' THEN 1.0 ELSE 0.0 END) AS usefulness
FROM memories m
LEFT JOIN feedback f ON f.memory_id = m.id AND f.created_at > now() - interval '30 days'
WHERE m.org_id = $1 AND m.agent_id = $2
GROUP BY m.id, m.category
ORDER BY usefulness DESC NULLS LAST
LIMIT 50;
""",
    """{"type": "function", "function": {"name": "get_weather", "description": "Get the
current weather for a city", "parameters": {"type": "object", "properties":
{"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius",
"fahrenheit"]}}, "required": ["city"], "additionalProperties": false}}}""",
    """#!/usr/bin/env bash
set -euo pipefail
for f in "$@"; do
  sha256sum "$f" | awk '{print $1}' > "${f}.sha256"
  gzip -9 --keep "$f" && echo "compressed: $f ($(stat -c%s "$f.gz") bytes)"
done
""",
    """<div class="card" data-id="42">
  <h2 class="card__title">Settings</h2>
  <input type="checkbox" id="dark" checked aria-label="Dark mode">
  <label for="dark">Dark mode</label>
</div>
""",
    """apiVersion: apps/v1
kind: Deployment
metadata:
  name: ibex
  labels: {app: ibex, tier: backend}
spec:
  replicas: 3
  template:
    spec:
      containers:
        - name: ibex
          image: registry.example.com/ibex:0.1.0
          resources: {limits: {cpu: "1", memory: 512Mi}}
""",
    """static int ring_push(struct ring *r, const uint8_t *buf, size_t n) {
    if (r->len + n > RING_CAP) return -ENOSPC;
    for (size_t i = 0; i < n; ++i)
        r->data[(r->head + r->len + i) & (RING_CAP - 1)] = buf[i];
    r->len += n;
    return 0;
}
""",
    """x=[[0]*8 for _ in range(8)];y={k:v**2 for k,v in zip('abcdefgh',range(8))};z=x[3][4]""",
    "    return None",
    "}",
    "import numpy as np",
]

_EMOJI = [
    "Happy birthday!!! 🎉🎂🥳 Hope your day is amazing 💖✨",
    "Flight landed ✈️ → taxi 🚕 → hotel 🏨 … finally sleeping 😴😴😴",
    "👨‍👩‍👧‍👦 family trip to the 🏖️ was the best! 🌊☀️🍦",
    "Team standup: ✅ deploy done, ⚠️ flaky test, ❌ migration blocked, 🔥 on-call page",
    "🇯🇵🇰🇷🇨🇳🇺🇸🇫🇷🇩🇪🇧🇷🇮🇳",
    "👍🏻👍🏼👍🏽👍🏾👍🏿 thumbs up in every skin tone",
    "🤖🧠💡📈📉📊🗂️🗃️🗄️🧾",
    "Loved it ❤️❤️❤️ 10/10 would go again 🙌🏽",
    "🏳️‍🌈🏳️‍⚧️🏴‍☠️🧑‍💻👩🏽‍🔬🧑🏿‍🚀",
    "The cat 🐈 knocked the plant 🪴 off the shelf again 😾 send help 🆘",
    "😀😃😄😁😆😅🤣😂🙂🙃🫠😉😊😇",
    "ok 👌",
    "🎉",
    "Weekly plan 🗓️:\n• Mon 🏋️ gym\n• Wed 🎸 guitar\n• Fri 🍕 pizza night",
]

_OTHER_SCRIPTS = [
    """Пользователь предпочитает короткие ответы утром и подробные объяснения вечером.
Он работает инженером по надёжности в логистической компании.""",
    """Η φωτοσύνθεση μετατρέπει την ενέργεια του φωτός σε χημική ενέργεια που
αποθηκεύεται στη γλυκόζη.""",
    """يفضل المستخدم الإجابات القصيرة في الصباح والشروحات المفصلة في المساء.
يعمل مهندسًا في شركة لوجستية.""",
    """המשתמש מעדיף תשובות קצרות בבוקר והסברים מפורטים בערב. הוא עובד כמהנדס
אמינות אתרים בחברת לוגיסטיקה.""",
    """उपयोगकर्ता सुबह छोटे उत्तर और शाम को विस्तृत स्पष्टीकरण पसंद करता है।
वह एक लॉजिस्टिक्स कंपनी में इंजीनियर के रूप में काम करता है।""",
    """ผู้ใช้ชอบคำตอบสั้น ๆ ในตอนเช้าและคำอธิบายโดยละเอียดในตอนเย็น
เขาทำงานเป็นวิศวกรในบริษัทโลจิสติกส์""",
    """Người dùng thích câu trả lời ngắn vào buổi sáng và giải thích chi tiết vào
buổi tối. Anh ấy làm kỹ sư tại một công ty hậu cần.""",
    """Der Benutzer bevorzugt morgens kurze Antworten und abends ausführliche
Erklärungen. Größere Änderungen müssen vorher abgestimmt werden.""",
    """L'utilisateur préfère des réponses courtes le matin et des explications
détaillées le soir. Il déteste les réunions après 17 h.""",
    "Ñandú, pingüino, acción, corazón — ¿qué más?",
]

_IDENTIFIERS = [
    "memory 3f2b9c1e-8d4a-4b7f-9e21-0c5d6a7b8e9f in org 0a1b2c3d-4e5f-6789-abcd-ef0123456789",
    "sha256: 223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "token=eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "https://example.com/api/v1/search?q=context+assembly&page=3&sort=desc#results",
    "Order #A7X-99213-QZ shipped via 1Z999AA10123456784 on 2024-11-02T14:33:07Z",
    "0x7fffd4a3b2c0 0x7fffd4a3b2c8 0x00007f1e2d3c4b5a segfault at 0000000000000018",
    "phone +1 (415) 555-0134, fax +44 20 7946 0958, zip 94107-1234",
    "3.14159265358979323846264338327950288419716939937510582097494459230781640628",
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
]

CATEGORIES: dict[str, list[str]] = {
    "english": _ENGLISH,
    "cjk": _CJK,
    "code": _CODE,
    "emoji": _EMOJI,
    "other_scripts": _OTHER_SCRIPTS,
    "identifiers": _IDENTIFIERS,
}


def adversarial() -> dict[str, str]:
    """Texts no memory looks like; reported apart, not part of ESTIMATE_MAX_UNDERCOUNT."""
    rng = random.Random(1)
    lower = "abcdefghijklmnopqrstuvwxyz"
    return {
        "random_lowercase": "".join(rng.choice(lower) for _ in range(500)),
        "random_alnum": "".join(
            rng.choice(lower + lower.upper() + "0123456789") for _ in range(500)
        ),
        "random_bmp": "".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(300)),
        "spaces": " " * 1000,
        "newlines": "\n" * 1000,
        "repeated_letter": "a" * 1000,
    }


def corpus() -> dict[str, list[str]]:
    """Each category's samples: every text whole, then each of its non-blank lines."""
    out: dict[str, list[str]] = {}
    for name, texts in CATEGORIES.items():
        samples: list[str] = []
        seen: set[str] = set()
        for text in texts:
            for piece in [text, *text.splitlines()]:
                if piece.strip() and piece not in seen:
                    seen.add(piece)
                    samples.append(piece)
        out[name] = samples
    return out


def measure(tokenizers: Tokenizers) -> dict[str, dict[str, float]]:
    """Per category: estimate/reference ratios, where reference = max(cl100k, o200k)."""
    cl100k = tokenizers.counter("openai-cl100k", "cl100k_base")
    o200k = tokenizers.counter("openai-o200k", "o200k_base")
    estimate = tokenizers.counter("claude", None)
    table: dict[str, dict[str, float]] = {}
    for name, samples in corpus().items():
        ratios = []
        under = 0
        for text in samples:
            ref = max(cl100k.count_uncached(text), o200k.count_uncached(text))
            est = estimate.count_uncached(text)
            ratios.append(est / ref)
            under += est < ref
        table[name] = {
            "samples": len(samples),
            "mean_ratio": sum(ratios) / len(ratios),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
            "underestimated": under,
            "worst_undercount": max(0.0, 1.0 - min(ratios)),
        }
    return table


def measure_adversarial(tokenizers: Tokenizers) -> dict[str, float]:
    """estimate/reference ratio for each adversarial text."""
    counters = [tokenizers.counter(f, e) for f, e in (("c", "cl100k_base"), ("o", "o200k_base"))]
    estimate = tokenizers.counter("claude", None)
    return {
        name: estimate.count_uncached(text) / max(c.count_uncached(text) for c in counters)
        for name, text in adversarial().items()
    }


def _estimate_speed(tokenizers: Tokenizers) -> dict[str, float]:
    """Microseconds per call: uncached estimate / exact count of a 1 KiB text, cache hit."""
    text = (_ENGLISH[0] + "\n" + _CODE[0])[:1024]
    out: dict[str, float] = {}
    for label, counter in (
        ("estimate_uncached_1k_us", tokenizers.counter("claude", None)),
        ("exact_o200k_uncached_1k_us", tokenizers.counter("openai-o200k", "o200k_base")),
    ):
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            counter.count_uncached(text)
        out[label] = (time.perf_counter() - t0) / n * 1e6
    hit = tokenizers.counter("openai-o200k", "o200k_base")
    hit.count(text)
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        hit.count(text)
    out["cache_hit_us"] = (time.perf_counter() - t0) / n * 1e6
    return out


def main() -> None:
    tokenizers = Tokenizers(None, 65536)
    tokenizers.preload(["cl100k_base", "o200k_base"])
    table = measure(tokenizers)
    speed = _estimate_speed(tokenizers)
    header = f"{'category':<14} {'n':>4} {'mean':>6} {'min':>6} {'max':>6} {'under':>5}"
    print("estimate_v1 / max(cl100k_base, o200k_base) exact count")
    print(header)
    print("-" * len(header))
    for name, row in table.items():
        print(
            f"{name:<14} {int(row['samples']):>4} {row['mean_ratio']:>6.2f} "
            f"{row['min_ratio']:>6.2f} {row['max_ratio']:>6.2f} {int(row['underestimated']):>5}"
        )
    worst = max(row["worst_undercount"] for row in table.values())
    print(f"worst undercount: {worst:.3f} (ESTIMATE_MAX_UNDERCOUNT = {ESTIMATE_MAX_UNDERCOUNT})")
    adv = measure_adversarial(tokenizers)
    print(
        "adversarial (not covered by the margin): "
        + ", ".join(f"{k} {v:.2f}" for k, v in adv.items())
    )
    for key, value in speed.items():
        print(f"{key}: {value:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "reference": "max(cl100k_base, o200k_base) exact, encode_ordinary",
                "estimate_kind": tokenizers.counter("claude", None).estimate_kind,
                "categories": table,
                "worst_undercount": worst,
                "estimate_max_undercount": ESTIMATE_MAX_UNDERCOUNT,
                "adversarial_ratio": adv,
                "speed": speed,
                "python": sys.version.split()[0],
                "machine": platform.machine(),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
