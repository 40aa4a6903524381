/* SPDX-License-Identifier: Apache-2.0 */
/* A tiny C consumer of an installed libtierstate_c: three AdamW steps in PinnedHost memory. */
#include <tierstate/c.h>

#include <stdio.h>
#include <string.h>

int main(void)
{
  float w[3000], g[3000];
  for (int i = 0; i < 3000; ++i) { w[i] = 1.0f; g[i] = 0.5f; }
  tierstate_options o;
  tierstate_options_init(&o);
  o.hyper.lr = 0.1;
  tierstate_optimizer* opt = NULL;
  tierstate_status s = tierstate_create(&o, &opt);
  if (s == TIERSTATE_OK) { s = tierstate_add_tensor(opt, "w", w, 3000); }
  const void* grads[] = {g};
  for (int i = 0; i < 3 && s == TIERSTATE_OK; ++i) { s = tierstate_step(opt, grads, 1, 1.0, NULL); }
  int const ok = s == TIERSTATE_OK && w[0] < 1.0f && tierstate_step_count(opt) == 3;
  const char* arch = tierstate_arch();
  printf("C consumer of tierstate %s (%s kernels): %s%s\n", tierstate_version(), arch ? arch : "no",
         ok ? "ok" : "wrong result ", s == TIERSTATE_OK ? "" : tierstate_last_error());
  tierstate_destroy(opt);
#if defined(EXPECTED_VERSION)
  if (strcmp(tierstate_version(), EXPECTED_VERSION) != 0) { return 1; }
#endif
  return ok ? 0 : 1;
}
