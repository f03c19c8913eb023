// The console's own script: the live toggle and the charts. No inline
// script anywhere (the Content-Security-Policy forbids it); data reaches it
// through data-* attributes only, as JSON, never as code.
"use strict";

(function () {
  var PAUSED_KEY = "switchboard.paused";

  function paused() {
    return document.body.dataset.paused === "yes";
  }

  function showToggle() {
    var button = document.querySelector("[data-testid=live-toggle]");
    if (!button) return;
    button.textContent = paused() ? "Resume live" : "Pause live";
    button.setAttribute("aria-pressed", paused() ? "true" : "false");
  }

  function setPaused(value) {
    document.body.dataset.paused = value ? "yes" : "no";
    try { sessionStorage.setItem(PAUSED_KEY, value ? "yes" : "no"); } catch (e) { /* storage off */ }
    showToggle();
  }

  var COLORS = ["#2b6cb0", "#c53030", "#2f855a", "#b7791f", "#6b46c1"];

  function buildChart(el) {
    if (typeof uPlot === "undefined" || el.dataset.built === "yes") return;
    var data;
    try { data = JSON.parse(el.dataset.chart); } catch (e) { return; }
    el.dataset.built = "yes";
    el.textContent = "";
    var spark = el.dataset.kind === "spark";
    var series = [{}];
    var columns = [data.x];
    data.series.forEach(function (s, i) {
      series.push({ label: s.label, stroke: COLORS[i % COLORS.length], width: spark ? 1 : 1.5, points: { show: el.dataset.kind === "latency" } });
      columns.push(s.values);
    });
    var opts = {
      width: spark ? 160 : Math.max(320, Math.min(620, el.clientWidth || 560)),
      height: spark ? 36 : 200,
      series: series,
      legend: { show: !spark },
      cursor: { show: !spark },
      axes: spark ? [{ show: false }, { show: false }] : [{}, { size: 60 }],
      scales: { x: { time: true } },
    };
    if (data.x.length === 0) {
      el.textContent = spark ? "-" : "no data in the last hour";
      return;
    }
    new uPlot(opts, columns, el);
  }

  function buildCharts(root) {
    (root || document).querySelectorAll("[data-chart]").forEach(buildChart);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var stored = null;
    try { stored = sessionStorage.getItem(PAUSED_KEY); } catch (e) { /* storage off */ }
    setPaused(stored === "yes");
    var button = document.querySelector("[data-testid=live-toggle]");
    if (button) button.addEventListener("click", function () { setPaused(!paused()); });
    buildCharts(document);
  });

  // A paused page sends no poll: htmx asks before each request.
  document.addEventListener("htmx:beforeRequest", function (evt) {
    var elt = evt.detail && evt.detail.elt;
    if (paused() && elt && elt.hasAttribute("data-live")) evt.preventDefault();
  });
  // A poll the console did not answer (the database or a broker away, the
  // session expired): the figures on the page are old, and say so.
  function markStale(evt, stale) {
    var elt = evt.detail && evt.detail.elt;
    if (elt && elt.hasAttribute("data-live")) elt.classList.toggle("stale", stale);
  }
  document.addEventListener("htmx:responseError", function (evt) { markStale(evt, true); });
  document.addEventListener("htmx:sendError", function (evt) { markStale(evt, true); });
  document.addEventListener("htmx:afterSettle", function (evt) {
    buildCharts(evt.detail && evt.detail.elt ? evt.detail.elt.parentNode || document : document);
  });
})();
