package console_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"google.golang.org/grpc/metadata"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/advice"
	"github.com/outboxd/outboxd/internal/testdb"
)

// chromium finds the browser: $OUTBOXD_CHROMIUM, else chromium on PATH
// (Debian's package installs /usr/bin/chromium). Without one the browser
// test is skipped locally but fails in CI (CI=true), where .ci/run
// installs it.
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("OUTBOXD_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "/usr/bin/chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("chromium not found and CI=true: the browser test must run in CI (apt-get install chromium; .ci/run does)")
	}
	t.Skip("chromium not found (apt-get install chromium, or set $OUTBOXD_CHROMIUM); skipping the browser test")
	return ""
}

// screenshotDir is $OUTBOXD_SCREENSHOTS, or a new folder under the
// temporary directory that outlives the test, so the pictures can be looked
// at afterwards; the test logs where.
func screenshotDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("OUTBOXD_SCREENSHOTS")
	var err error
	if dir != "" {
		err = os.MkdirAll(dir, 0o755)
	} else {
		dir, err = os.MkdirTemp("", "outboxd-console-screenshots-")
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshots in %s", dir)
	return dir
}

// The console in a real browser (headless Chromium, driven over the
// DevTools protocol by chromedp): log in, watch a stream's lag, open a
// parked aggregate from the events browser, skip its poisoned event with a
// reason and see the skip recorded under the token's name; then the pages
// for aggregates, purge dry run, bulk dry run and relays. Each step waits
// for what the page shows, never for time, and leaves a screenshot at a
// laptop's size (1366x768, full page).
func TestBrowser(t *testing.T) {
	t.Parallel()
	exe := chromium(t)
	shots := screenshotDir(t)
	h := newHarness(t, harnessOptions{})
	parked := h.park(t, "sales_order", "42", 2)
	h.emit(t, "sales_order", "43", 1)
	// Another parked aggregate, still parked when the aggregates and bulk
	// pages are visited.
	h.park(t, "billing.refund", "r-1", 1)

	// A relay holding billing deliveries without acking them, to show in
	// flight.
	h.emit(t, "billing.invoice", "i-seed", 1)
	relayCtx, stopRelay := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+relaySecret))
	defer stopRelay()
	sub, err := h.rep.Relay.Subscribe(relayCtx, &outboxv1.SubscribeRequest{RelayId: "billing-relay-1",
		Streams: []string{"billing.invoice"}, MaxInFlight: 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Header(); err != nil {
		t.Fatal(err)
	}

	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(exe),
		chromedp.Flag("headless", true),
		chromedp.NoSandbox, // runs as root in CI
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		// The machine has no internet: nothing may try to reach it.
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1366, 768),
	}
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(t.Context(), opts...)
	defer cancelAlloc()
	browserCtx, cancelBrowser := chromedp.NewContext(allocCtx, chromedp.WithLogf(t.Logf))
	defer cancelBrowser()
	// The first Do starts the browser, which lives as long as browserCtx;
	// the steps after it run under a hang guard.
	if err := chromedp.Do(browserCtx, chromedp.EmulateViewport(1366, 768)); err != nil {
		t.Fatalf("start chromium %s: %v", exe, err)
	}
	ctx, cancel := context.WithTimeout(browserCtx, 3*time.Minute)
	defer cancel()

	n := 0
	shot := func(name string) chromedp.Action[chromedp.Void] {
		return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			png, err := chromedp.FullScreenshot(100)(ctx, tg)
			if err != nil {
				return err
			}
			n++
			return os.WriteFile(filepath.Join(shots, fmt.Sprintf("%02d-%s.png", n, name)), png, 0o644)
		})
	}
	run := func(step string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		began := time.Now()
		if err := chromedp.Do(ctx, actions...); err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		t.Logf("browser: %s (%v)", step, time.Since(began).Round(time.Millisecond))
	}
	// text reads an element's text in one evaluation, so a table the page
	// script re-renders meanwhile cannot detach the node halfway.
	text := func(sel string) string {
		t.Helper()
		s, err := chromedp.Run(ctx, chromedp.Evaluate[string](fmt.Sprintf(`document.querySelector(%s).innerText`, strconv.Quote(sel))))
		if err != nil {
			t.Fatalf("read %s: %v", sel, err)
		}
		return s
	}
	// loads runs a step that navigates (a click, a submit) and waits for the
	// new page's load event, subscribed to before the step runs: a wait for
	// an element afterwards cannot be met by the page being left.
	loads := func(step chromedp.Action[chromedp.Void]) chromedp.Action[chromedp.Void] {
		return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			_, err := chromedp.WaitEvent(page.LoadEventFired, nil, step)(ctx, tg)
			return err
		})
	}
	css := func(s string) chromedp.CSS { return chromedp.CSS(s) }
	base := h.srv.URL

	run("open the console: the login page",
		chromedp.Navigate(base+"/"),
		chromedp.WaitVisible(css("#token")),
		shot("login"))
	run("log in",
		chromedp.SendKeys(css("#token"), adminSecret),
		loads(chromedp.Click(css("#login"))),
		chromedp.WaitVisible(css("#streams")))
	if got := text("header .who"); !strings.Contains(got, "ops") {
		t.Errorf("header shows %q, want the token's name ops", got)
	}

	// A held xmin horizon is warned of once the page polls (the hold
	// begins after the page was drawn), and the warning goes with it.
	release := testdb.HoldXminHorizon(t, t.Context(), h.url, "report-browser", false, advice.XminHorizonWarnAge)
	run("a held xmin horizon is warned of", chromedp.WaitVisible(css("#warnings p")), shot("xmin-horizon"))
	if got := text("#warnings"); !strings.Contains(got, "PostgreSQL's xmin horizon is held") {
		t.Errorf("the warning reads %q", got)
	}
	release()
	run("the warning goes when the hold ends", chromedp.WaitNotPresent(css("#warnings p")))

	// Lag grows in three steps while the page polls: each step waits until
	// the page shows the new total, so the chart has a history to draw.
	// checkTicks: the chart's gridlines are labelled with whole, evenly
	// spaced numbers from 0 up to at least min.
	checkTicks := func(min int) {
		t.Helper()
		ticks, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`Array.from(document.querySelectorAll("#chart text.ytick")).map(e => e.textContent)`))
		if err != nil {
			t.Fatal(err)
		}
		if len(ticks) != 5 {
			t.Fatalf("chart y labels %q, want 5", ticks)
		}
		step, _ := strconv.Atoi(ticks[1])
		for i, tick := range ticks {
			if v, err := strconv.Atoi(tick); err != nil || v != i*step || step < 1 {
				t.Errorf("chart y labels %q: not whole multiples of one step", ticks)
				break
			}
		}
		if top, _ := strconv.Atoi(ticks[4]); top < min {
			t.Errorf("chart y labels %q: the top is below %d", ticks, min)
		}
	}
	// The header shows each poll's own lag read, the chart the console's
	// samples (every SampleInterval), so the chart can show a total a poll
	// or two after the header does: wait for its legend to show it.
	chartShows := func(total int) chromedp.Action[chromedp.Void] {
		return chromedp.Poll[chromedp.Void](fmt.Sprintf(
			`(document.querySelector("#legend span") || {}).textContent === "all streams (%d)"`, total))
	}
	total := 5
	for i := range 3 {
		h.emit(t, "billing.invoice", "i-"+strconv.Itoa(i), 2+2*i)
		total += 2 + 2*i
		run("see the lag grow", chromedp.Poll[chromedp.Void](fmt.Sprintf(`document.getElementById("total-pending").textContent === "%d"`, total)))
		if i == 0 {
			// A small maximum (5 to 7), whose gridlines a step of a quarter
			// of it would put between whole numbers.
			run("see the chart", chromedp.WaitVisible(css("#chart svg path.series")), chartShows(total))
			checkTicks(5)
		}
	}
	run("see the chart", chromedp.WaitVisible(css("#chart svg path.series")), chartShows(total))
	checkTicks(total)
	rows := text("#streams tbody")
	if !strings.Contains(rows, "sales_order") || !strings.Contains(rows, "billing.invoice") {
		t.Errorf("streams table: %q", rows)
	}
	if got := text(`#streams tbody tr:has(a[href*="sales_order"]) td.bad`); got != "1" {
		t.Errorf("parked aggregates of sales_order: %q, want 1", got)
	}
	// The rows the page script drew have a cell per column.
	cells, err := chromedp.Run(ctx, chromedp.Evaluate[[]int](`Array.from(document.querySelectorAll("#streams tr")).map(r => r.cells.length)`))
	if err != nil {
		t.Fatal(err)
	}
	for i, n := range cells {
		if n != cells[0] {
			t.Errorf("streams table row %d has %d cells, the header %d", i, n, cells[0])
		}
	}
	run("screenshot the streams", shot("streams"))

	run("find the parked aggregate in the events browser",
		loads(chromedp.Click(css(`nav a[href="/events"]`))),
		chromedp.WaitVisible(css(`form.filters`)),
		chromedp.SetValue(css(`input[name="stream"]`), "sales_order"),
		chromedp.SetValue(css(`select[name="state"]`), "pending"),
		loads(chromedp.Submit(css(`input[name="stream"]`))),
		chromedp.WaitVisible(css(`#events a[href*="key=42"]`)),
		chromedp.Click(css(`#events tbody tr:last-child summary`)),
		chromedp.WaitVisible(css(`#events tbody tr:last-child details pre`)),
		shot("events"))
	if got := text(`#events tbody tr:last-child details`); !strings.Contains(got, `"order_id": "42"`) || !strings.Contains(got, "traceparent") {
		t.Errorf("payload and headers view: %q", got)
	}
	run("open the parked aggregate",
		loads(chromedp.Click(css(`#events a[href*="key=42"]`))),
		chromedp.WaitVisible(css("#agg-state")),
		shot("aggregate-parked"))
	if got := text("#agg-state"); got != "parked" {
		t.Fatalf("aggregate state %q, want parked", got)
	}
	if got := text("main"); !strings.Contains(got, "schema v3 unknown") {
		t.Errorf("the aggregate page does not show the last error")
	}

	const reason = "poison message: schema v3 is unknown to the sink (INC-4711)"
	run("skip the poisoned event with a reason",
		chromedp.SendKeys(css(`#pending tbody tr:first-child input[name="reason"]`), reason),
		loads(chromedp.Click(css(`#pending tbody tr:first-child button`))),
		chromedp.WaitVisible(css(".flash.ok")),
		shot("skipped"))
	if got := text(".flash.ok"); !strings.Contains(got, parked.GetEventId()) || !strings.Contains(got, "skipped by ops") {
		t.Errorf("confirmation: %q", got)
	}
	if got := text("#recent"); !strings.Contains(got, "skipped") || !strings.Contains(got, reason) || !strings.Contains(got, "ops") {
		t.Errorf("latest events after the skip: %q", got)
	}
	if got := text("#agg-pending"); got != "1" {
		t.Errorf("pending after the skip: %q, want 1", got)
	}
	info := h.eventState(t, "sales_order", "42", parked.GetEventId())
	if info.GetState() != outboxv1.EventState_EVENT_STATE_SKIPPED || info.GetSkip().GetActor() != "ops" || info.GetSkip().GetReason() != reason {
		t.Errorf("the server recorded %v by %q (%q)", info.GetState(), info.GetSkip().GetActor(), info.GetSkip().GetReason())
	}

	run("aggregates in trouble",
		loads(chromedp.Click(css(`nav a[href="/aggregates"]`))),
		chromedp.WaitVisible(css(`main table.grid tbody a[href*="key=r-1"]`)),
		shot("aggregates"))
	if got := text("main table.grid tbody"); !strings.Contains(got, "billing.refund") || !strings.Contains(got, "parked") ||
		!strings.Contains(got, "schema v3 unknown") || strings.Contains(got, "sales_order") {
		t.Errorf("aggregates in trouble: %q, want billing.refund/r-1 parked with its error, not the skipped one", got)
	}
	run("purge dry run",
		loads(chromedp.Click(css(`nav a[href="/purge"]`))),
		chromedp.WaitVisible(css("#purge-dry-run")),
		loads(chromedp.Click(css("#purge-dry-run"))),
		chromedp.WaitVisible(css("#purge-result")),
		shot("purge"))
	if got := text("#purge-result"); !strings.Contains(got, "would delete 0 event(s)") {
		t.Errorf("purge dry run: %q", got)
	}
	run("bulk dry run of a prefix",
		chromedp.Navigate(base+"/bulk?state=parked&stream=billing.*"),
		loads(chromedp.Click(css("#dry-run"))),
		chromedp.WaitVisible(css(`section.confirm`)),
		shot("bulk"))
	if got := text("section.confirm"); !strings.Contains(got, "Dry run: 1 aggregate(s) match") || !strings.Contains(got, "r-1") {
		t.Errorf("bulk dry run: %q", got)
	}
	if st := h.aggState(t, "billing.refund", "r-1"); st != outboxv1.AggregateState_AGGREGATE_STATE_PARKED {
		t.Errorf("after the dry run billing.refund/r-1 is %v", st)
	}
	// The form as it loads (retry, "parked, backing off or gap", no reason)
	// is a valid request: dry run, then confirm.
	run("bulk retry with the form's defaults",
		loads(chromedp.Click(css(`nav a[href="/bulk"]`))),
		chromedp.WaitVisible(css("#dry-run")),
		loads(chromedp.Click(css("#dry-run"))),
		// The dry run's count, or the refusal.
		chromedp.WaitVisible(css(`section.confirm, .flash.error`)))
	if got := text("main"); !strings.Contains(got, "Dry run: 1 aggregate(s) match") || !strings.Contains(got, "r-1") {
		t.Fatalf("bulk dry run with the defaults: %q", got)
	}
	run("confirm the bulk retry",
		loads(chromedp.Click(css("#confirm"))),
		chromedp.WaitVisible(css(".flash.ok")),
		shot("bulk-retried"))
	if got := text(".flash.ok"); !strings.Contains(got, "Bulk retry: 1 matched, 1 retried") {
		t.Errorf("bulk retry confirmation: %q", got)
	}
	if st := h.aggState(t, "billing.refund", "r-1"); st != outboxv1.AggregateState_AGGREGATE_STATE_READY {
		t.Errorf("after the bulk retry billing.refund/r-1 is %v, want ready", st)
	}
	run("relays",
		loads(chromedp.Click(css(`nav a[href="/relays"]`))),
		chromedp.WaitVisible(css("#relays")),
		shot("relays"))
	if got := text("#relays"); !strings.Contains(got, "billing-relay-1") || !strings.Contains(got, "2 / 2") {
		t.Errorf("relays page: %q", got)
	}
	run("back to the streams page", chromedp.Navigate(base+"/"), chromedp.WaitVisible(css("#chart svg path.series")),
		shot("streams-after"))
}
