// tokenline dashboard: refresh a page's content in place, without a full reload.
// A page marked data-refresh="N" fetches itself as a fragment every N seconds and swaps
// it in. Without JavaScript every page still works; reload to refresh.
(function () {
  "use strict";
  var main = document.getElementById("content");
  if (!main || !main.dataset.refresh) { return; }
  var every = Math.max(1, parseInt(main.dataset.refresh, 10)) * 1000;
  function refresh() {
    var url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    fetch(url, { headers: { "Accept": "text/html" }, credentials: "same-origin" })
      .then(function (r) { return r.ok || r.status === 503 ? r.text() : null; })
      .then(function (html) {
        if (html !== null) {
          main.innerHTML = html;
          main.dataset.refreshedAt = String(Date.now());
        }
      })
      .catch(function () { /* the next round tries again */ })
      .finally(function () { window.setTimeout(refresh, every); });
  }
  window.setTimeout(refresh, every);
})();
