// sagaflow UI: a little progressive enhancement. Every page works without it.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  // Filter links stay short: empty fields are left out of the URL.
  var filter = document.getElementById("filter");
  if (filter) {
    filter.addEventListener("submit", function () {
      Array.prototype.forEach.call(filter.elements, function (el) {
        if (el.name && el.value === "") { el.disabled = true; }
      });
    });
  }
  // A confirmation is sent once, however often the button is pressed.
  Array.prototype.forEach.call(document.querySelectorAll("form.confirm"), function (form) {
    form.addEventListener("submit", function (ev) {
      if (form.dataset.sent) { ev.preventDefault(); return; }
      form.dataset.sent = "1";
      var b = form.querySelector("button[type=submit]");
      if (b) { b.textContent = "Working…"; }
    });
  });
  // Times are shown in UTC; the local time is in the tooltip.
  Array.prototype.forEach.call(document.querySelectorAll("time[datetime]"), function (t) {
    var d = new Date(t.getAttribute("datetime"));
    if (!isNaN(d.getTime())) { t.title = d.toLocaleString(); }
  });
  document.body.dataset.ready = "1";
});
